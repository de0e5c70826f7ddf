"""The one place reasonkv meets transformers at run time: the cache keyword and ``logits_to_keep``
(:mod:`~reasonkv.hf.forward`), layers, kinds and model facts (:mod:`~reasonkv.hf.model`) and the attention
tap (:mod:`~reasonkv.hf.tap`). Besides, only the cache (transformers' ``Cache`` subclassed) and ``models/``
import transformers.
"""

from reasonkv.hf.capture import StepCapture
from reasonkv.hf.forward import (
    Forward,
    cache_keyword,
    cached_kv,
    left_pad,
    native_cache,
    plain_cache,
    static_cache,
    synchronize,
)
from reasonkv.hf.masks import LayerMasks
from reasonkv.hf.model import (
    attention_implementation,
    attention_modules,
    decoder_layers,
    layer_kinds,
    masks_per_layer_type,
    model_info,
    sliding_window,
    text_config,
    transformers_version,
    vocab_size,
)
from reasonkv.hf.tap import AttentionTap, KernelReader

__all__ = [
    "StepCapture",
    "AttentionTap",
    "KernelReader",
    "Forward",
    "LayerMasks",
    "attention_implementation",
    "attention_modules",
    "cache_keyword",
    "cached_kv",
    "decoder_layers",
    "layer_kinds",
    "left_pad",
    "masks_per_layer_type",
    "native_cache",
    "model_info",
    "plain_cache",
    "sliding_window",
    "static_cache",
    "synchronize",
    "text_config",
    "transformers_version",
    "vocab_size",
]
