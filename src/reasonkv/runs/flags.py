"""Settings declared once: each field of a frozen settings dataclass carries its command-line flag.

A field made with :func:`setting` holds, beside its default, how the command line spells it (:class:`Flag`).
From that one declaration :mod:`reasonkv.cli.flags` adds the arguments to a parser and reads them back as the
dataclass's keywords, and :func:`spell` and :func:`flag_values` write a settings object back as the command that
reproduces it and as the parser's values (what a run records). The dataclass itself still checks its values
(once, in ``__post_init__``), so a Python caller and the command line meet the same rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Flag", "dest", "flag_values", "flags", "nested", "option", "setting", "spell"]


@dataclass(frozen=True)
class Flag:
    """How one setting appears on the command line (``help`` to ``required`` as argparse takes them)."""

    group: str  # the argument group's title
    help: str | None = None
    type: Callable[[str], Any] | str | None = None  # or the name of one of the command line's types ("non-negative")
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    required: bool = False
    short: str | None = None  # an extra short form (-o)
    negated: bool = False  # a switch that defaults to on, spelled --no-NAME
    repeated: bool = False  # may be given several times (a tuple of the values given)
    optional_value: bool = False  # alone means True, or takes one value (--compile [BACKEND])
    always: bool = False  # spelled out even at its default (what a reader of the command needs to see)
    in_command: bool = True  # False for how the run shows itself (progress bars): the reproducing command omits it
    # The name of a set of flags several commands share (model, policy options, buffer, allocation), added by the
    # command line's own helper (with shared_with's keywords), once for all the fields that name it.
    shared: str | None = None
    shared_with: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    name: str | None = None  # the flag when it is not the field's name (--gate-steps for a field steps)


def setting(default: Any = dataclasses.MISSING, **flag: Any) -> Any:
    """A dataclass field with its :class:`Flag` (``default``: the setting's default, also the flag's)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(**flag)})


def nested(cls) -> Any:
    """A dataclass field holding the settings class ``cls`` (default: its defaults), whose flags are added and
    read in this field's place."""
    return dataclasses.field(default_factory=cls, metadata={"settings": cls})


def flags(cls) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of the settings class ``cls`` that are flags, with their :class:`Flag`, in order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def option(field: dataclasses.Field, flag: Flag) -> str:
    """The flag's long form (``--prefill-to-length``, ``--no-progress``)."""
    return flag.name or ("--no-" if flag.negated else "--") + field.name.replace("_", "-")


def dest(field: dataclasses.Field, flag: Flag) -> str:
    """Where the parser keeps the flag's value."""
    return option(field, flag)[2:].replace("-", "_")


def _text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def spell(settings: Any) -> list[str]:
    """The flags that rebuild ``settings``: each one off its default (or marked ``always``), in field order."""
    words: list[str] = []
    for field, flag in flags(type(settings)):
        value = getattr(settings, field.name)
        if not flag.in_command or value is None or (value == field.default and not flag.always):
            continue
        name = option(field, flag)
        if flag.negated or value is True:
            words.append(name)
        elif value is False:
            continue
        elif flag.repeated:
            for item in value:
                words += [flag.short or name, str(item)]
        else:
            words += [name, _text(value)]
    return words


def flag_values(settings: Any) -> dict[str, Any]:
    """``settings`` as the parser's values (destination -> value, lists as the text the flags take)."""
    values = {}
    for field, flag in flags(type(settings)):
        value = getattr(settings, field.name)
        if flag.negated:
            value = not value
        elif flag.repeated:
            value = list(value)
        elif isinstance(value, (tuple, list)) or hasattr(value, "__fspath__"):
            value = _text(value)
        values[dest(field, flag)] = value
    return values
