"""``reasonkv report``: markdown table, JSON summary and PNG plots from eval results files."""

from __future__ import annotations

import argparse
import sys

from reasonkv.eval.report import write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="JSONL results file(s) written by `reasonkv eval`")
    parser.add_argument("--out", default="report", help="output directory (default ./report)")
    parser.add_argument("--quiet", action="store_true", help="do not print the table")


def run(args: argparse.Namespace) -> int:
    written = write_report(args.results, args.out)
    if not args.quiet:
        print(written["markdown"].read_text(encoding="utf-8"))
    print(f"wrote {written['markdown']}, {written['summary']} and {len(written['plots'])} plots", file=sys.stderr)
    for path in written["plots"]:
        print(f"  {path}", file=sys.stderr)
    return 0
