"""Deprecated alias: ``reasonkv.decode`` moved to :mod:`reasonkv.generation.loop`; this name keeps old code working."""

from __future__ import annotations

import importlib
import warnings

warnings.warn("reasonkv.decode moved to reasonkv.generation.loop; import it from there", DeprecationWarning, stacklevel=2)
_TARGET = importlib.import_module("reasonkv.generation.loop")


def __getattr__(name: str):
    return getattr(_TARGET, name)


def __dir__() -> list[str]:
    return dir(_TARGET)
