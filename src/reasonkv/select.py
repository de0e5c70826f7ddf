"""Deprecated alias: ``reasonkv.select`` moved to :mod:`reasonkv.policies.select`; this name keeps old code working."""

from __future__ import annotations

import importlib
import warnings

_NEW = "reasonkv.policies.select"
warnings.warn(
    "reasonkv.select moved to reasonkv.policies.select; import it from there", DeprecationWarning, stacklevel=2
)
_TARGET = importlib.import_module(_NEW)


def __getattr__(name: str):
    return getattr(_TARGET, name)


def __dir__() -> list[str]:
    return dir(_TARGET)
