"""The ``reasonkv`` command line: generate | policies | demo | eval | report | bench | calibrate.

Every command lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``; this
file only dispatches. Modules import torch/transformers inside ``run`` so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help). Modules that are absent (a partial install) are skipped.
COMMANDS = {
    "generate": ("reasonkv.commands.generate", "decode prompts with an evicting KV cache"),
    "policies": ("reasonkv.commands.policies", "list the eviction policies and their options"),
    "demo": ("reasonkv.commands.demo", "full cache vs an evicting policy, side by side, on the bundled model"),
    "eval": ("reasonkv.eval.cli", "run a benchmark grid (datasets x policies x budgets)"),
    "report": ("reasonkv.eval.report_cli", "tables and plots from an eval results file"),
    "bench": ("reasonkv.bench.cli", "speed and memory benchmark"),
    "calibrate": ("reasonkv.analysis.cli", "find a model's EPIKV layer bands"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reasonkv", description="KV-cache eviction for long chain-of-thought decoding."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and module_name.startswith(error.name):
                continue  # command not part of this installation
            raise
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as error:
        print(f"reasonkv {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"reasonkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
