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


def lazy_exports(namespace: dict, exports: dict[str, str]):
    """A package's module ``__getattr__`` (PEP 562): ``name`` is imported from the module ``exports[name]`` on
    first use and kept in ``namespace`` (the package's ``globals()``), so importing the package stays light."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    return __getattr__


__getattr__ = lazy_exports(globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
