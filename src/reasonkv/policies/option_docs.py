"""What each option of a policy means, read from where it is written: the class docstrings.

Every policy documents its options in a numpy-style ``Parameters`` section of its docstring (the
options every policy has, ``sinks``, ``window`` and ``protect_prompt``, in :class:`~reasonkv.policies.Policy`'s).
:func:`option_meanings` reads them, the class's own first and then its bases', and keeps the first
sentence of each: the one line ``reasonkv policies`` prints beside the option. A class that documents
several options in one entry (``sinks, window, protect_prompt``: a remark on their defaults) keeps, for
each, a base class's own entry when there is one.
"""

from __future__ import annotations

import inspect
import re

__all__ = ["first_sentence", "option_meanings", "parameters"]

_HEADER = re.compile(r"^([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?::.*)?$")
_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]*\.)?([^`]+)`")  # :mod:`reasonkv.policies.calibration` -> calibration


def parameters(doc: str | None) -> dict[str, tuple[str, int]]:
    """``name -> (description, names in its entry)`` of a numpy-style ``Parameters`` section."""
    lines = inspect.cleandoc(doc or "").splitlines()
    starts = [i for i in range(len(lines) - 1) if lines[i].strip() == "Parameters" and set(lines[i + 1]) == {"-"}]
    if not starts:
        return {}
    out: dict[str, list[str]] = {}
    names: list[str] = []
    shared: dict[str, int] = {}
    for i in range(starts[0] + 2, len(lines)):
        line = lines[i]
        if not line.strip():
            continue
        if not line.startswith(" "):
            if i + 1 < len(lines) and lines[i + 1] and set(lines[i + 1].strip()) == {"-"}:
                break  # the next section
            header = _HEADER.match(line.strip())
            if not header:
                break
            names = [n.strip() for n in header.group(1).split(",")]
            for name in names:
                out[name], shared[name] = [], len(names)
        elif names:
            for name in names:
                out[name].append(line.strip())
    return {name: (" ".join(text), shared[name]) for name, text in out.items()}


def first_sentence(text: str) -> str:
    """The first sentence of ``text``, without reST markup (````x```` -> ``x``)."""
    plain = _ROLE.sub(r"\1", text).replace("``", "")
    match = re.match(r"(.+?[.!?])(?:\s|$)", plain)
    return (match.group(1) if match else plain).strip()


def option_meanings(cls: type) -> dict[str, str]:
    """``option -> its meaning in one sentence`` for the options a policy class documents (see the module)."""
    entries: dict[str, tuple[str, int]] = {}
    for klass in cls.__mro__:
        for name, (text, together) in parameters(klass.__doc__).items():
            held = entries.get(name)
            if held is None or (held[1] > 1 and together == 1):  # a base's own entry over a shared remark
                entries[name] = (text, together)
    return {name: first_sentence(text) for name, (text, _) in entries.items() if text}
