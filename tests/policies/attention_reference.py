"""Reference attention for the policy tests: drive an evicting cache, then recompute attention without it.

The policy tests check a policy's scores against attention computed independently of the cache:

- :func:`drive` prefills a prompt into a :class:`reasonkv.EvictingCache` and teacher-forces tokens one
  at a time, recording what the cache held before each decode step (and, optionally, a policy table
  after every forward pass);
- :func:`eager_attentions` is the model's own eager attention over the whole sequence, no cache;
- :func:`masked_attentions` and :func:`masked_hidden_states` run the whole sequence in one cache-free
  forward in which every decoded query of each kv head attends to exactly the positions the evicting
  cache held at that step (plus itself), so they reproduce what the cache saw.

Imported from the test files of this folder as a sibling module (``from attention_reference import ...``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.modeling_utils import AttentionInterface

import reasonkv
from reasonkv.hf import cache_keyword

__all__ = ["drive", "eager_attentions", "masked_attentions", "masked_hidden_states"]

PROBE = "reasonkv_test_masked_probe"  # the attention implementation registered below


def drive(
    model,
    prompt: list[int],
    tokens: list[int],
    *,
    policy: str,
    budget: int,
    buffer: int,
    snapshot: Callable[[object], torch.Tensor] | None = None,
    **options,
):
    """Prefill ``prompt``, then feed ``tokens`` one at a time (teacher forcing) through an evicting cache.

    ``policy`` and ``options`` go to :class:`reasonkv.EvictingCache`. ``snapshot``, if given, maps the
    cache's policy to a tensor (say, row 0 of a score table); a clone of it is taken after the prefill
    and after every decode step.

    Returns ``(cache, held, snapshots)``: the detached cache; ``held[step][layer]``, the positions
    ``[kv_heads, slots]`` of row 0 held before decode step ``step`` (-1: padding); and the snapshots,
    one per forward pass (``len(tokens) + 1``; empty without ``snapshot``).
    """
    cache = reasonkv.EvictingCache(budget, buffer, model=model, policy=policy, **options)
    key, layers = cache_keyword(model), model.config.num_hidden_layers
    held, snapshots = [], []

    def record():
        if snapshot is not None:
            snapshots.append(snapshot(cache.evictor.policy).clone())

    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), use_cache=True, **{key: cache})
        record()
        for token in tokens:
            held.append([cache.positions(layer)[0].clone() for layer in range(layers)])
            model(input_ids=torch.tensor([[token]]), use_cache=True, **{key: cache})
            record()
    cache.detach()
    return cache, held, snapshots


def eager_attentions(model, ids: list[int]) -> list[torch.Tensor]:
    """Per layer ``[query_heads, T, T]`` (float64): the model's own eager attention weights, no cache."""
    original = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), use_cache=False, output_attentions=True)
    finally:
        model.config._attn_implementation = original
    return [a[0].double() for a in out.attentions]


def masked_attentions(model, ids: list[int], prompt_len: int, held, dtype: torch.dtype = torch.float64):
    """Per layer ``[query_heads, T, T]``: attention rows over exactly what the evicting cache held.

    ``ids`` is the prompt followed by the decoded tokens, ``held`` as returned by :func:`drive`; the
    attention is computed in ``dtype``. Prompt queries (and decoded ones past ``held``) are causal.
    """
    _, probs = _masked_forward(model, ids, prompt_len, held, dtype)
    return probs


def masked_hidden_states(model, ids: list[int], prompt_len: int, held, dtype: torch.dtype = torch.float64):
    """The hidden states (embeddings, then every layer's output) of the forward of :func:`masked_attentions`."""
    out, _ = _masked_forward(model, ids, prompt_len, held, dtype, output_hidden_states=True)
    return out.hidden_states


# ------------------------------------------------------------------------------------- the probe
@dataclass
class _ProbeState:
    """What the probe reads (``masks``, ``dtype``) and records (``probs``), per layer, during one forward."""

    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    dtype: torch.dtype = torch.float64


_STATE = _ProbeState()


def _probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention where query ``t`` of kv head ``h`` sees exactly ``masks[layer][h, t]``; records the weights."""
    dtype = _STATE.dtype
    groups = query.shape[1] // key.shape[1]
    allowed = _STATE.masks[module.layer_idx].repeat_interleave(groups, dim=0)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query.to(dtype), key.to(dtype).transpose(2, 3)) * scaling
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    _STATE.probs[module.layer_idx] = probs[0]
    out = torch.matmul(probs, value.to(dtype)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(PROBE, _probe)


def _held_masks(model, total: int, prompt_len: int, held) -> dict[int, torch.Tensor]:
    """Per layer ``[kv_heads, T, T]`` booleans: causal, except that the query of decode step ``s`` (at
    ``prompt_len + s``) sees exactly the positions held before that step, and itself."""
    masks = {}
    for layer in range(model.config.num_hidden_layers):
        kv_heads = held[0][layer].shape[0] if held else model.config.num_key_value_heads
        allowed = torch.tril(torch.ones(total, total, dtype=torch.bool)).expand(kv_heads, -1, -1).clone()
        for step, positions in enumerate(held):
            t = prompt_len + step
            row = torch.zeros(kv_heads, total, dtype=torch.bool)
            row.scatter_(1, positions[layer].clamp(min=0), positions[layer] >= 0)
            row[:, t] = True
            allowed[:, t] = row
        masks[layer] = allowed
    return masks


def _masked_forward(model, ids, prompt_len, held, dtype, **kwargs):
    """One cache-free forward through the probe; returns the model output and the per-layer weights."""
    _STATE.masks.update(_held_masks(model, len(ids), prompt_len, held))
    _STATE.dtype = dtype
    original = model.config._attn_implementation
    model.config._attn_implementation = PROBE
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), use_cache=False, **kwargs)
        return out, [_STATE.probs[layer].clone() for layer in range(model.config.num_hidden_layers)]
    finally:
        model.config._attn_implementation = original
        _STATE.masks.clear()
        _STATE.probs.clear()
