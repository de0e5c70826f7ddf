"""``python -m reasonkv.cli.paired RESULTS... --against POLICY``: each policy's top-1 agreement against a
reference policy's, paired by problem, with 95% bootstrap intervals (see :mod:`reasonkv.eval.paired`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from reasonkv.eval.paired import markdown, paired_fidelity
from reasonkv.eval.report import load_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reasonkv.cli.paired", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="eval results files (JSONL) with fidelity records")
    parser.add_argument("--against", default="h2o", help="the reference policy's label (default h2o)")
    parser.add_argument("--out", type=Path, help="write the tables to this markdown file instead of printing them")
    args = parser.parse_args(argv)
    try:  # a run still in progress has only its shard files: load_results reads those too
        text = markdown(paired_fidelity(load_results(args.results), args.against), args.against)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text, encoding="utf-8")
        print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
