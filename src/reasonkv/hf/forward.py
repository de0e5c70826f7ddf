"""One way to call a transformers causal LM with a cache, used by generation, benchmarks, fidelity
replays and the layer anatomy: the cache keyword (``past_key_values``, renamed ``cache`` in newer
transformers), ``logits_to_keep``, left padding and device synchronisation live here only."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, StaticCache

__all__ = [
    "Forward",
    "cache_keyword",
    "cached_kv",
    "left_pad",
    "native_cache",
    "plain_cache",
    "static_cache",
    "synchronize",
]


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes its cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Forward:
    """Calls ``model`` with a cache: ``Forward(model)(input_ids, cache)`` returns the model's output (the
    signature of ``model.forward`` read once)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache_key = cache_keyword(model)
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: Any,
        *,
        attention_mask: Any = None,
        position_ids: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ):
        """Run one forward pass that appends ``input_ids`` to ``cache``; ``last_logits_only``: the last
        position's logits alone (``[batch, 1, vocab]``) where the model supports ``logits_to_keep``."""
        kwargs: dict[str, Any] = {self.cache_key: cache, "use_cache": True}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if last_logits_only and self.keeps_logits:
            kwargs["logits_to_keep"] = 1
        return self.model(input_ids=input_ids, **kwargs)

    def newest_logits(self, input_ids: torch.Tensor, cache: Any, attention_mask: Any = None) -> torch.Tensor:
        """The forward pass's logits at its last position alone, ``[batch, vocab]`` (what a decode step samples
        from)."""
        return self(input_ids, cache, attention_mask=attention_mask, last_logits_only=True).logits[:, -1]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows as one left-padded batch: ``(ids, mask)``, both ``[len(rows), longest]``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_cache():
    """transformers' own dynamic cache, holding every key of every layer (no window applied)."""
    return DynamicCache()


def native_cache(model: torch.nn.Module):
    """The cache ``model.generate`` itself builds: transformers' dynamic cache with the model's own layer
    kinds (a sliding-window layer holds its window), the reference for what reasonkv's cache costs."""
    return DynamicCache(config=model.config)


def static_cache(model: torch.nn.Module, capacity: int):
    """transformers' fixed-size cache of ``capacity`` slots per row (allocated at the first forward): what
    transformers compiles decoding over, the reference for reasonkv's compiled steps."""
    return StaticCache(config=model.config, max_cache_len=capacity)


def cached_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a transformers cache holds for ``layer``."""
    entry = cache.layers[layer]
    return entry.keys, entry.values
