"""The transformers binding of eviction: the cache's settings (``spec``), its storage (``storage``,
``layer``, ``rows``), the evictor that drives it and what it records from the model (``evictor``,
``observe``), their composition (``evicting``), the quantized tier (``tiers``, ``quantize``: torch only)
and hybrid layer kinds (``hybrid``).

The names below load on first use, so the torch-only modules (``reasonkv.cache.tiers``) import without
transformers.
"""

from __future__ import annotations

from reasonkv import lazy_exports

_EXPORTS = {
    "CacheSpec": "reasonkv.cache.spec",
    "DEFAULT_BUFFER": "reasonkv.cache.spec",
    "EvictingCache": "reasonkv.cache.evicting",
    "KVStorage": "reasonkv.cache.storage",
    "kv_bytes_by_kind": "reasonkv.cache.storage",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(globals(), _EXPORTS)
