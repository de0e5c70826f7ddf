"""The command line's side of settings declared once (:mod:`reasonkv.runs.flags`): add a settings class's flags
to a parser, and read the parsed values back as its keywords."""

from __future__ import annotations

import argparse
from typing import Any

from reasonkv.cli.args import (
    add_allocation_arguments,
    add_buffer_argument,
    add_compile_argument,
    add_model_arguments,
    add_policy_options,
    add_tier_arguments,
    code_memory_argument,
    code_timeout_argument,
    int_list_argument,
    non_negative_argument,
    positive_rate_argument,
)
from reasonkv.runs.flags import dest, flags, option

__all__ = ["add_flags", "read_flags"]

# The flag sets several commands share, each added by its one helper.
SHARED = {
    "model": add_model_arguments,
    "policy options": add_policy_options,
    "buffer": add_buffer_argument,
    "allocation": add_allocation_arguments,
    "tier": add_tier_arguments,
    "compile": add_compile_argument,
}
# The argument types a settings class names (their messages name the flag; a plain int would not).
TYPES = {
    "non-negative": non_negative_argument,
    "int-list": int_list_argument,
    "positive-rate": positive_rate_argument,
    "code-timeout": code_timeout_argument,
    "code-memory": code_memory_argument,
}


def add_flags(parser: argparse.ArgumentParser, cls, descriptions: dict[str, str] | None = None) -> None:
    """Add every flag of the settings class ``cls`` to ``parser``, in the fields' order, in their groups
    (``descriptions``: what a group says before its flags, by its title)."""
    groups: dict[str, Any] = {}
    added: set[str] = set()
    for field, flag in flags(cls):
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group, (descriptions or {}).get(flag.group))
        group = groups[flag.group]
        if flag.shared is not None:
            if flag.shared not in added:
                added.add(flag.shared)
                SHARED[flag.shared](group, **flag.shared_with)
            continue
        names = [option(field, flag)] + ([flag.short] if flag.short else [])
        if flag.negated or (field.type in (bool, "bool") and not flag.optional_value):
            group.add_argument(*names, action="store_true", help=flag.help)
            continue
        if field.type == "bool | None":  # on, off, or not said (--NAME / --no-NAME)
            group.add_argument(*names, action=argparse.BooleanOptionalAction, default=None, help=flag.help)
            continue
        extra: dict[str, Any] = {"help": flag.help}
        for name in ("type", "choices", "metavar"):
            if getattr(flag, name) is not None:
                extra[name] = getattr(flag, name)
        if isinstance(flag.type, str):
            extra["type"] = TYPES[flag.type]
        if flag.required:
            extra["required"] = True
        else:
            extra["default"] = [] if flag.repeated else field.default
        if flag.repeated:
            extra["action"] = "append"
        if flag.optional_value:
            extra.update(nargs="?", const=True)
        group.add_argument(*names, **extra)


def read_flags(cls, args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of ``cls`` that the parsed ``args`` give (a negated switch read back as its setting)."""
    values = {}
    for field, flag in flags(cls):
        value = getattr(args, dest(field, flag))
        values[field.name] = (not value) if flag.negated else value
    return values
