"""``reasonkv lm-eval ARGS``: lm-evaluation-harness's own command line, with reasonkv's model and local tasks.

Every argument is lm-eval's. lm-eval 0.4 does not look for models in other installed packages, so this command
registers the ``reasonkv`` model and then runs lm-eval's command line, adding what the user did not give
(docs/lm-eval.md): ``--model reasonkv``, ``--include_path`` to reasonkv's local tasks, and ``--device cpu`` on a
machine without CUDA (lm-eval's default is ``cuda:0``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from reasonkv.integrations.lm_eval import TASKS_DIR  # says what to install when lm-eval is missing

# main.py builds this command's parser to take every argument as it is (options of lm-eval's included).
FORWARDS_ARGUMENTS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arguments", nargs="*", help="lm-eval's arguments (reasonkv lm-eval --help lists them)")


def run(args: argparse.Namespace) -> int:
    from lm_eval.__main__ import cli_evaluate  # lm-eval's entry point (an optional extra: see the import above)

    saved = sys.argv
    sys.argv = ["lm-eval", *harness_arguments(args.arguments, cuda=torch.cuda.is_available())]
    try:
        cli_evaluate()
    except SystemExit as done:  # lm-eval's parser exits (--help, a bad argument): its code is ours
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


def harness_arguments(arguments: Sequence[str], *, cuda: bool) -> list[str]:
    """lm-eval's arguments with reasonkv's defaults added where the user gave none (see the module docstring)."""
    argv = list(arguments)
    if argv and argv[0] in ("ls", "validate"):
        return argv if _given(argv, "--include_path") else [*argv, "--include_path", str(TASKS_DIR)]
    if argv and argv[0] == "run":
        argv = argv[1:]
    added = []
    if not _given(argv, "--model", "-M", "--config", "-C"):
        added += ["--model", "reasonkv"]
    if not _given(argv, "--include_path"):
        added += ["--include_path", str(TASKS_DIR)]
    if not cuda and not _given(argv, "--device"):
        added += ["--device", "cpu"]
    return ["run", *added, *argv]


def _given(argv: Sequence[str], *flags: str) -> bool:
    return any(word == flag or word.startswith(f"{flag}=") for word in argv for flag in flags)
