"""What reasonkv reads off a transformers model: its decoder layers and attention modules, the kind
of every layer, its attention shape and its attention implementation. One definition of each."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import transformers

from reasonkv.hf.rotary import rotary_embeddings, weights_fingerprint
from reasonkv.policies.contract import ModelInfo

__all__ = [
    "attention_implementation",
    "attention_modules",
    "decoder_layers",
    "layer_kinds",
    "masks_per_layer_type",
    "model_info",
    "sliding_window",
    "text_config",
    "transformers_version",
    "vocab_size",
]

# transformers' `layer_types` names -> reasonkv's layer kinds (contract.LAYER_KINDS). Legacy names
# that transformers itself remaps ("attention", "mamba", "conv") are accepted too.
_KINDS = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
    "mamba": "linear",
    "conv": "linear",
}


def text_config(model_or_config: Any):
    """The decoder's config (multimodal wrappers keep it in a text sub-config)."""
    config = getattr(model_or_config, "config", model_or_config)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def num_layers(config: Any) -> int:
    config = text_config(config)
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    raise ValueError(f"cannot find the number of layers in a config of type {type(config).__name__}")


def layer_kinds(model_or_config: Any) -> tuple[str, ...]:
    """The kind of every decoder layer: ``"full"``, ``"sliding"``, ``"chunked"`` or ``"linear"``; ``ValueError``
    for an unknown layer type. ``layer_types`` decides when the config has it; otherwise a set ``sliding_window``
    makes every layer sliding unless ``use_sliding_window`` is false, and with it true the layers before
    ``max_window_layers`` keep full attention (the older Qwen2 convention)."""
    config = text_config(model_or_config)
    n = num_layers(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        for index, name in enumerate(layer_types):
            if name not in _KINDS:
                raise ValueError(
                    f"layer {index} has type {name!r}, which reasonkv cannot cache; known layer types: "
                    f"{', '.join(sorted(_KINDS))}"
                )
        return tuple(_KINDS[name] for name in layer_types)
    use_flag = getattr(config, "use_sliding_window", None)
    if getattr(config, "sliding_window", None) is None or use_flag is False:
        return ("full",) * n
    start = min(int(getattr(config, "max_window_layers", 0) or 0) if use_flag else 0, n)
    return ("full",) * start + ("sliding",) * (n - start)


def model_info(model_or_config: Any) -> ModelInfo:
    """The attention shape of a model or config: layers, heads, kv heads, head dim, layer kinds; for a
    model (not a config) also each layer's rotary embedding and a fingerprint of its weights."""
    config = text_config(model_or_config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    info = ModelInfo(num_layers(config), heads, kv_heads, head_dim, layer_kinds(config))
    if not isinstance(model_or_config, torch.nn.Module):
        return info
    model = model_or_config
    rotary = rotary_embeddings(model, config, attention_modules(model), head_dim)
    return dataclasses.replace(info, rotary=rotary, fingerprint=weights_fingerprint(model))


def sliding_window(model_or_config: Any) -> int | None:
    """The window of the model's sliding-window layers (``None`` when it has none)."""
    window = getattr(text_config(model_or_config), "sliding_window", None)
    return None if window is None else int(window)


Mask = TypeVar("Mask")


def masks_per_layer_type(model: Any, build: Callable[[int | None], Mask]) -> Mask | dict[str, Mask]:
    """An explicit attention mask in the form the model takes, ``build(window)`` making one (None: no window):
    one per layer type when the config lists ``layer_types`` (sliding types with the window), else one."""
    config = text_config(model)
    layer_types = getattr(config, "layer_types", None)
    full = build(None)
    if not layer_types:
        return full
    window = sliding_window(config)
    sliding = {name for name in layer_types if _KINDS.get(name) == "sliding"}
    return {name: build(window) if name in sliding and window is not None else full for name in set(layer_types)}


def vocab_size(model: Any) -> int:
    return int(text_config(model).vocab_size)


def attention_implementation(model: Any) -> str:
    """The name of the attention kernel the model runs (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``...).

    transformers exposes it only as the config's ``_attn_implementation`` property (the value its public
    ``set_attn_implementation`` sets); this is the one place reasonkv reads it.
    """
    return text_config(model)._attn_implementation or "eager"


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM."""
    for owner in (getattr(model, "model", None), model):
        for holder in (owner, getattr(owner, "language_model", None)):
            layers = getattr(holder, "layers", None)
            if isinstance(layers, torch.nn.ModuleList):
                return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module | None]:
    """Each decoder layer's attention module (``None`` for a layer without one, e.g. linear attention)."""
    held = (
        [getattr(layer, name, None) for name in ("self_attn", "attention", "attn")] for layer in decoder_layers(model)
    )
    return [next((module for module in modules if module is not None), None) for modules in held]


def transformers_version() -> str:
    return transformers.__version__
