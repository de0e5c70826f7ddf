"""The transformers binding of eviction: the cache's settings (``spec``), its storage (``storage``,
``layer``, ``rows``), the evictor that drives it and what it records from the model (``evictor``,
``observe``), their composition (``evicting``), the quantized tier (``tiers``, ``quantize``: torch only)
and hybrid layer kinds (``hybrid``).

The names below load on first use, so the torch-only modules (``reasonkv.cache.tiers``) import without
transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CacheSpec": "reasonkv.cache.spec",
    "DEFAULT_BUFFER": "reasonkv.cache.spec",
    "EvictingCache": "reasonkv.cache.evicting",
    "KVStorage": "reasonkv.cache.storage",
    "kv_bytes_by_kind": "reasonkv.cache.storage",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'reasonkv.cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
