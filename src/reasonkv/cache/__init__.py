"""The transformers binding of eviction: the cache's settings, its storage, the evictor that drives it,
what it records from the model, the quantized tier and hybrid layer kinds."""

from __future__ import annotations

from reasonkv.cache.storage import EvictingCache, kv_bytes_by_kind

__all__ = ["EvictingCache", "kv_bytes_by_kind"]
