"""``python -m reasonkv.cli.equal_bytes RESULTS... --out DIR``: the equal-bytes fidelity tables and plots;
``--size-for TOKENS``: the tier sizes that fill a byte budget (see :mod:`reasonkv.eval.equal_bytes`)."""

from __future__ import annotations

import argparse

from reasonkv.eval.equal_bytes import tier_sizes, write_tables
from reasonkv.eval.report import load_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reasonkv.cli.equal_bytes", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="eval results files (JSONL)")
    parser.add_argument("--out", help="folder for equal-bytes.md and the PNGs")
    parser.add_argument(
        "--size-for",
        type=float,
        metavar="TOKENS",
        help="instead of the tables: per tiered policy, bits and K measured at two or more Q, print "
        "'POLICY BITS K Q', the Q whose measured bytes hold TOKENS full-precision tokens",
    )
    args = parser.parse_args(argv)
    if (args.out is None) == (args.size_for is None):
        parser.error("give --out DIR (the tables) or --size-for TOKENS (the tier sizes), one of the two")
    if args.size_for is not None:
        sizes = tier_sizes(load_results(args.results), args.size_for)
        if not sizes:
            parser.error("no tiered fidelity records measured at two or more Q for one policy and bits")
        for size in sizes:
            print(size["policy"], size["bits"], size["budget"], size["quantized"])
        return 0
    try:
        written = write_tables(args.results, args.out)
    except ValueError as error:
        parser.error(str(error))
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
