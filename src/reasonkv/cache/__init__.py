"""The transformers binding of eviction: the cache's settings (``spec``), its storage (``storage``,
``layer``, ``rows``), the evictor that drives it and what it records from the model (``evictor``,
``observe``), their composition (``evicting``), the quantized tier (``tiers``, ``quantize``) and hybrid
layer kinds (``hybrid``)."""

from __future__ import annotations

from reasonkv.cache.evicting import EvictingCache
from reasonkv.cache.spec import DEFAULT_BUFFER, CacheSpec
from reasonkv.cache.storage import KVStorage, kv_bytes_by_kind

__all__ = ["DEFAULT_BUFFER", "CacheSpec", "EvictingCache", "KVStorage", "kv_bytes_by_kind"]
