"""``reasonkv policies``: every registered policy with its granularity and hyper-parameters."""

from __future__ import annotations

import argparse
import json

from reasonkv.policies import list_policies, policy_class


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    rows = []
    for name in list_policies():
        cls = policy_class(name)
        rows.append(
            {
                "name": name,
                "granularity": cls.granularity,
                "summary": cls.summary,
                "paper": cls.paper,
                "options": cls.options(),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        print(f"{row['name']:<{width}} [{row['granularity']}] {row['summary']}")
        if row["paper"]:
            print(f"{'':<{width}} {row['paper']}")
        options = ", ".join(f"{k}={v!r}" for k, v in row["options"].items())
        print(f"{'':<{width}} options: {options}")
    return 0
