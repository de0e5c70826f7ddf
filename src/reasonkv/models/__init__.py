"""Loading models for reasonkv: :func:`load_model` and the names it takes (:data:`BUNDLED`, :func:`list_shapes`).

One module per concern, each importing only those listed before it: ``devices`` (dtype, device and attention
implementation, checked before any load), ``files`` (is a model intact?), ``shapes``, ``checkpoint`` (and the
tokenizer settings every loader applies), ``gguf``, ``bundled``, ``hub`` (the local cache when the hub cannot be
reached) and ``load`` (which tells the kinds of names apart).
"""

from __future__ import annotations

from reasonkv.models.bundled import (
    BUNDLED,
    DEFAULT_MODEL,
    GEMMA3_INSTALL_COMMAND,
    GEMMA3_PACKAGE,
    SMOLLM2_INSTALL_COMMAND,
    SMOLLM2_PACKAGE,
    Bundled,
    bundled_model,
    cache_dir,
)
from reasonkv.models.devices import resolve_attn_implementation, resolve_device, resolve_dtype
from reasonkv.models.files import CorruptModelError
from reasonkv.models.load import load_model
from reasonkv.models.shapes import SHAPE_PREFIX, list_shapes, random_model, shape_config

__all__ = [
    "BUNDLED",
    "DEFAULT_MODEL",
    "GEMMA3_INSTALL_COMMAND",
    "GEMMA3_PACKAGE",
    "SHAPE_PREFIX",
    "SMOLLM2_INSTALL_COMMAND",
    "SMOLLM2_PACKAGE",
    "Bundled",
    "CorruptModelError",
    "bundled_model",
    "cache_dir",
    "list_shapes",
    "load_model",
    "random_model",
    "resolve_attn_implementation",
    "resolve_device",
    "resolve_dtype",
    "shape_config",
]
