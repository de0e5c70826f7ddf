"""``reasonkv policies [NAME]``: every registered policy (or one) with its granularity and its options,
each with its default and what it does (read from the policy's docstring)."""

from __future__ import annotations

import argparse
import inspect
import json

from reasonkv.policies import list_policies, policy_class
from reasonkv.policies.option_docs import option_meanings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default=None, help="one policy (default: all of them)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _describe(name: str) -> dict:
    cls = policy_class(name)  # an unknown name: ValueError listing the valid ones
    meanings = option_meanings(cls)
    return {
        "name": name,
        "granularity": cls.granularity,
        "summary": cls.summary,
        "paper": cls.paper,
        "description": inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " "),
        "options": cls.options(),
        "meanings": {option: meanings.get(option, "") for option in cls.options()},
    }


def run(args: argparse.Namespace) -> int:
    rows = [_describe(name) for name in ([args.name] if args.name else list_policies())]
    if args.json:
        print(json.dumps(rows if args.name is None else rows[0], indent=2, default=str))
        return 0
    for row in rows:
        print(f"{row['name']} [{row['granularity']}] {row['summary']}" + (f"  {row['paper']}" if row["paper"] else ""))
        if args.name:
            print(f"  {row['description']}")
        settings = {option: f"{option}={value!r}" for option, value in row["options"].items()}
        width = max(map(len, settings.values()), default=0)
        for option, setting in settings.items():
            print(f"  -o {setting:<{width}}  {row['meanings'][option]}")
        print()
    return 0
