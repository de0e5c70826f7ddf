"""``python -m reasonkv.cli.equal_bytes RESULTS... --out DIR``: the equal-bytes fidelity tables and plots
(see :mod:`reasonkv.eval.equal_bytes`)."""

from __future__ import annotations

import argparse

from reasonkv.eval.equal_bytes import write_tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reasonkv.cli.equal_bytes", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="eval results files (JSONL)")
    parser.add_argument("--out", required=True, help="folder for equal-bytes.md and the PNGs")
    args = parser.parse_args(argv)
    try:
        written = write_tables(args.results, args.out)
    except ValueError as error:
        parser.error(str(error))
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
