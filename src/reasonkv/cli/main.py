"""The ``reasonkv`` command line: generate | policies | demo | inspect | eval | report | bench | calibrate | lm-eval.

Every command lives in its own module of this package exposing ``add_arguments(parser)`` and
``run(args)``; this file dispatches (importing the chosen command's module only, so ``--help`` stays
fast), checks at start-up that reasonkv's dependencies are installed, and turns user errors into one
line and exit code 2 (``errors.py`` decides which errors are the user's; others keep their traceback).
A module with ``FORWARDS_ARGUMENTS = True`` hands its arguments to another program's command line
(``lm-eval``): its parser takes every word as it is, options and ``--help`` included.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import shlex
import sys
from collections.abc import Iterable
from typing import NoReturn

from reasonkv.cli.errors import missing_requirements, user_message

# command -> (module, one-line help). Modules that are absent (a partial install) are skipped.
COMMANDS = {
    "generate": ("reasonkv.cli.generate", "decode prompts with an evicting KV cache"),
    "policies": ("reasonkv.cli.policies", "list the eviction policies and their options"),
    "demo": ("reasonkv.cli.demo", "full cache vs an evicting policy, side by side, on the bundled model"),
    "inspect": ("reasonkv.cli.inspect", "one prompt, full vs policies: an interactive page of every eviction"),
    "eval": ("reasonkv.cli.eval", "run a benchmark grid (datasets x policies x budgets)"),
    "report": ("reasonkv.cli.report", "tables and plots from an eval results file"),
    "bench": ("reasonkv.cli.bench", "speed and memory benchmark"),
    "calibrate": ("reasonkv.cli.calibrate", "find a model's EPIKV layer bands"),
    "lm-eval": ("reasonkv.cli.lm_eval", "lm-evaluation-harness with reasonkv's model and local tasks (extra: lm-eval)"),
}
DEBUG_ENV = "REASONKV_DEBUG"
DEBUG_HELP = f"show the Python traceback of every error, not just one line (or set {DEBUG_ENV}=1)"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (``reasonkv eval: error: ...``) and a pointer to ``--help``,
    not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The command-line parser; the arguments of the commands in ``load`` (default: all) are read from their
    modules, the others are listed by name only (so ``reasonkv CMD`` imports CMD's module alone)."""
    load = set(COMMANDS if load is None else load)
    parser = Parser(prog="reasonkv", description="KV-cache eviction for long chain-of-thought decoding.")
    # --debug before or after the command: show the traceback of user errors too.
    debug = argparse.ArgumentParser(add_help=False)
    for taking in (debug, parser):
        taking.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if name not in load:
            sub.add_parser(name, help=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and module_name.startswith(error.name):
                continue  # command not part of this installation
            if not error.name or error.name.split(".")[0] == "reasonkv":
                raise
            # A third-party package is missing: the command stays listed and, whatever its arguments, says
            # what to install.
            command = sub.add_parser(name, help=help_text, prefix_chars="\0", add_help=False)  # takes every word
            command.add_argument("arguments", nargs="*")
            command.set_defaults(run=functools.partial(_raise, error))
            continue
        if getattr(module, "FORWARDS_ARGUMENTS", False):
            command = sub.add_parser(name, help=help_text, prefix_chars="\0", add_help=False)
        else:
            command = sub.add_parser(name, help=help_text, description=help_text, parents=[debug])
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((word for word in argv if not word.startswith("-")), None)
    args = build_parser([command] if command in COMMANDS else []).parse_args(argv)
    name = f"reasonkv {args.command}"
    if missing := missing_requirements():
        listed = " ".join(shlex.quote(r) for r in missing)
        print(f"{name}: error: reasonkv's dependencies are not all installed; pip install {listed}", file=sys.stderr)
        return 2
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whoever read the output stopped (`reasonkv generate ... | head`): nothing to report, and
        # stdout goes to devnull so that Python's own final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as error:
        message = None if getattr(args, "debug", False) or os.environ.get(DEBUG_ENV) else user_message(error, args)
        if message is None:
            raise
        print(f"{name}: error: {message}", file=sys.stderr)
        return 2


def _raise(error: BaseException, args: argparse.Namespace) -> int:
    raise error


if __name__ == "__main__":
    sys.exit(main())
