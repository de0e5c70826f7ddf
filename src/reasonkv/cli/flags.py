"""The command line's side of settings declared once (:mod:`reasonkv.runs.flags`): add the flags of one settings
class, or of the several a command builds one of, to a parser, and read the parsed values back as a class's
keywords."""

from __future__ import annotations

import argparse
import dataclasses
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
    fraction_argument,
    int_list_argument,
    non_negative_argument,
    positive_argument,
    positive_or_all_argument,
    positive_rate_argument,
)
from reasonkv.runs.flags import Flag, dest, option

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
    "positive": positive_argument,
    "positive or all": positive_or_all_argument,
    "fraction": fraction_argument,
    "int-list": int_list_argument,
    "positive-rate": positive_rate_argument,
    "code-timeout": code_timeout_argument,
    "code-memory": code_memory_argument,
}


def _flags(cls) -> list[tuple[dataclasses.Field, Flag]]:
    """The flags of ``cls`` in field order, those of a nested settings class (:func:`~reasonkv.runs.flags.nested`)
    in its field's place."""
    found = []
    for field in dataclasses.fields(cls):
        if "settings" in field.metadata:
            found += _flags(field.metadata["settings"])
        elif "flag" in field.metadata:
            found.append((field, field.metadata["flag"]))
    return found


def add_flags(parser: argparse.ArgumentParser, *classes, descriptions: dict[str, str] | None = None) -> None:
    """Add the flags of the settings ``classes`` to ``parser``: a flag several classes declare (the same
    destination, or the same shared set) once, in its groups, group after group in the order the groups first
    appear, the parser's own options (group ``"options"``) last; within a group, in the fields' order
    (``descriptions``: what a group says before its flags, by its title)."""
    groups = {group.title: group for group in parser._action_groups}
    declared: dict[str, tuple[dataclasses.Field, Flag]] = {}
    for cls in classes:
        for field, flag in _flags(cls):
            declared.setdefault(flag.shared or dest(field, flag), (field, flag))
    order = list(dict.fromkeys(flag.group for _, flag in declared.values()))
    order.sort(key=lambda title: groups.get(title) is parser._optionals)
    for title in order:
        if title not in groups:
            groups[title] = parser.add_argument_group(title, (descriptions or {}).get(title))
        for field, flag in declared.values():
            if flag.group == title:
                _add(groups[title], field, flag)


def _add(group, field: dataclasses.Field, flag: Flag) -> None:
    if flag.shared is not None:
        SHARED[flag.shared](group, **flag.shared_with)
        return
    names = [option(field, flag)] + ([flag.short] if flag.short else [])
    if flag.negated or (field.type in (bool, "bool") and not flag.optional_value):
        group.add_argument(*names, action="store_true", help=flag.help)
        return
    if field.type == "bool | None":  # on, off, or not said (--NAME / --no-NAME)
        group.add_argument(*names, action=argparse.BooleanOptionalAction, default=None, help=flag.help)
        return
    typed = TYPES[flag.type] if isinstance(flag.type, str) else flag.type
    given = {"type": typed, "choices": flag.choices, "metavar": flag.metavar}
    extra: dict[str, Any] = {"help": flag.help} | {name: value for name, value in given.items() if value is not None}
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
    """The keywords of ``cls`` that the parsed ``args`` give (a negated switch read back as its setting, a nested
    settings class built from its own flags)."""
    values = {}
    for field in dataclasses.fields(cls):
        if "settings" in field.metadata:
            values[field.name] = field.metadata["settings"](**read_flags(field.metadata["settings"], args))
        elif "flag" in field.metadata:
            flag = field.metadata["flag"]
            value = getattr(args, dest(field, flag))
            values[field.name] = (not value) if flag.negated else value
    return values
