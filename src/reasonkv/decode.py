"""Deprecated alias: ``reasonkv.decode`` moved to :mod:`reasonkv.generation.loop`; this name keeps old code working."""

from __future__ import annotations

import importlib
import warnings

_NEW = "reasonkv.generation.loop"
warnings.warn(
    "reasonkv.decode moved to reasonkv.generation.loop; import it from there", DeprecationWarning, stacklevel=2
)
_TARGET = importlib.import_module(_NEW)


def __getattr__(name: str):
    return getattr(_TARGET, name)


def __dir__() -> list[str]:
    return dir(_TARGET)
