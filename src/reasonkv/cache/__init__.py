"""The transformers binding of eviction: settings (``spec``), storage (``storage``, ``layer``, ``rows``), the
evictor and what it records (``evictor``, ``observe``), selection (``selecting``), their composition
(``evicting``), the quantized tier (``tiers``, ``quantize``: torch only) and hybrid layer kinds (``hybrid``).
The names below load on first use, so the torch-only modules import without transformers.
"""

from __future__ import annotations

from reasonkv import lazy_exports

_MODULES = {
    "spec": ("CacheSpec", "DEFAULT_BUFFER"),
    "evicting": ("EvictingCache",),
    "storage": ("KVStorage", "kv_bytes_by_kind"),
}
_EXPORTS = {name: f"reasonkv.cache.{module}" for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(globals(), _EXPORTS)
