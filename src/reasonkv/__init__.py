"""reasonkv: keep the KV cache of long chain-of-thought decoding within a fixed budget.

Quick start::

    import reasonkv
    model, tokenizer = reasonkv.load_model("smollm2-135m")
    [result] = reasonkv.generate(model, tokenizer, "2 + 2 = ?", policy="streaming", budget=256)

The names below load on first use, so light submodules (``reasonkv.eval.grading``) import without torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CacheSpec": "reasonkv.cache.spec",
    "EvictingCache": "reasonkv.cache.evicting",
    "GenerationResult": "reasonkv.generation",
    "generate": "reasonkv.generation",
    "Policy": "reasonkv.policies",
    "get_policy": "reasonkv.policies",
    "list_policies": "reasonkv.policies",
    "register": "reasonkv.policies",
    "load_model": "reasonkv.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'reasonkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
