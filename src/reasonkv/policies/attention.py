"""Attention recomputed for a few recorded queries: ``softmax(q · Kᵀ · scaling)`` over stored keys, in
``O(queries x slots)`` memory, while the model's own kernel does the real attention. Torch only.

Shapes: queries ``[B, Hq, w, D]``, keys ``[B, Hkv, S, D]``; query head ``h`` reads kv head ``h // (Hq // Hkv)``
(transformers' ``repeat_kv``). Logit soft-capping (Gemma 2) and learned attention sinks (GPT-OSS's
``s_aux``: one extra logit per query head in the softmax, then dropped) are applied when given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Kernel",
    "column_sums",
    "grouped_logits",
    "grouped_sinks",
    "key_mask",
    "masked_softmax_",
    "newest_row",
    "window_attention",
]


@dataclass(frozen=True)
class Kernel:
    """What one layer's attention kernel applies besides ``q · Kᵀ``: its ``scaling``, logit ``softcap`` and learned
    ``sinks`` (``[Hq]``); None where the model uses none."""

    scaling: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @classmethod
    def of(cls, query: torch.Tensor, kwargs: dict) -> Kernel:
        """The kernel an attention tap saw called with ``kwargs`` on ``query`` (``1/sqrt(head_dim)`` unless scaled)."""
        sinks = kwargs.get("s_aux", kwargs.get("sinks"))
        return cls(kwargs.get("scaling") or query.shape[-1] ** -0.5, kwargs.get("softcap"), sinks)


def grouped_logits(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None = None
) -> torch.Tensor:
    """Attention logits in float32, grouped by kv head: ``[B, Hkv, g, w, S]`` with ``g = Hq // Hkv``.

    The product runs in float32 on every device, as SDPA and FlashAttention compute their logits (a
    half-precision matmul would round them to the cache dtype before the scaling, as only eager
    attention does). The queries are few (a window, or the newest of each forward); the keys are upcast
    once per call, so a caller that reads one layer's keys several times passes them as float32.
    ``softcap`` (when not None) caps them as the model's kernel does: ``softcap * tanh(x / softcap)``.
    """
    b, hq, w, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    grouped = queries.reshape(b, hkv, g * w, d).float()  # query head h -> kv head h // g
    logits = torch.matmul(grouped, keys.float().transpose(2, 3))
    # In place on the fresh product: the same arithmetic as out-of-place, without a buffer per step.
    logits.mul_(scaling)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits.view(b, hkv, g, w, s)


def grouped_sinks(sinks: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Per-query-head sink logits ``[Hq]`` shaped to broadcast against :func:`grouped_logits`: ``[1, Hkv, g, 1, 1]``."""
    return sinks.float().view(1, kv_heads, -1, 1, 1)


def masked_softmax_(
    logits: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor | None = None, *, start: int = 0
) -> torch.Tensor:
    """Softmax over the visible entries of the last axis; rows that see nothing are 0. Overwrites
    ``logits`` (pass a temporary, as :func:`grouped_logits` returns).

    ``visible`` covers the entries from column ``start`` on; every row sees the columns before it
    (a caller that knows so masks only the rest). ``sinks`` (broadcastable to ``logits[..., :1]``)
    are extra logits that share the normalisation and are dropped afterwards: learned attention
    sinks, so a row's probabilities sum to less than 1.
    """
    logits[..., start:].masked_fill_(~visible, float("-inf"))
    if sinks is None:
        return logits.softmax(-1).nan_to_num_(0.0)
    sink = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    return torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]


def key_mask(key_valid: torch.Tensor, heads: int) -> torch.Tensor:
    """``key_valid`` ``[B, S]`` (every head alike) or ``[B, Hkv, S]`` (per kv head) as a mask broadcasting
    against ``[B, Hq, q, S]``."""
    if key_valid.dim() == 2:
        return key_valid.view(key_valid.shape[0], 1, 1, key_valid.shape[1])
    return key_valid.repeat_interleave(heads // key_valid.shape[1], dim=1).unsqueeze(2)


def window_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    kernel: Kernel,
) -> torch.Tensor:
    """Attention of recorded queries over the stored keys, ``[B, Hq, w, S]`` probabilities.

    ``query_positions``/``query_valid`` are ``[B, w]``; ``key_positions`` ``[B, Hkv, S]`` and
    ``key_valid`` ``[B, S]``; a key at a negative position (a head's own padding) is not seen either.
    A query sees the keys at or before its own logical position (causal);
    rows of padding queries are 0.
    """
    b, hq, w, _ = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    logits = grouped_logits(queries, keys, kernel.scaling, kernel.softcap)
    visible = key_positions.view(b, hkv, 1, 1, s) <= query_positions.view(b, 1, 1, w, 1)
    visible = visible & key_valid.view(b, 1, 1, 1, s) & query_valid.view(b, 1, 1, w, 1)
    visible = visible & (key_positions >= 0).view(b, hkv, 1, 1, s)
    sink = None if kernel.sinks is None else grouped_sinks(kernel.sinks, hkv)
    return masked_softmax_(logits, visible, sink).view(b, hq, w, s)


def newest_row(query: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    """Attention row of one query per row (``[B, Hq, 1, D]``) over every valid stored key: ``[B, Hq, S]``.

    The query is the newest token, so every stored key is at or before it; ``key_valid`` ``[B, S]``.
    """
    b, hq = query.shape[:2]
    s = keys.shape[2]
    logits = grouped_logits(query, keys, kernel.scaling, kernel.softcap).view(b, hq, s)
    sink = None if kernel.sinks is None else kernel.sinks.float().view(1, hq, 1)
    return masked_softmax_(logits, key_valid.view(b, 1, s), sink)


def column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    query_valid: torch.Tensor,
    kernel: Kernel,
    chunk_elements: int = 1 << 24,
) -> torch.Tensor:
    """Attention each stored key received from the ``q`` queries of one forward, summed: ``[B, Hq, S]``.

    The queries are the newest ``q`` slots (query ``i`` sits at slot ``S - q + i`` and sees the slots
    up to its own, causal); padding queries (``query_valid`` ``[B, q]`` False) add nothing. ``key_valid``
    is ``[B, S]``, or ``[B, Hkv, S]`` when heads hold padding of their own. Built
    ``chunk_elements`` logits at a time, so memory stays ``O(chunk)``, never ``O(q x S)`` at once.
    """
    b, hq, q, _ = queries.shape
    s = keys.shape[2]
    total = queries.new_zeros((b, hq, s), dtype=torch.float32)
    keys = keys.float()  # once, not per chunk
    chunk = max(1, chunk_elements // max(1, b * hq * s))
    slot = torch.arange(s, device=queries.device)
    sink = None if kernel.sinks is None else kernel.sinks.float().view(1, hq, 1, 1)
    for start in range(0, q, chunk):
        part = queries[:, :, start : start + chunk]
        c = part.shape[2]
        seen = s - q + start + c  # causal: the chunk's queries see no slot after its last one
        logits = grouped_logits(part, keys[:, :, :seen], kernel.scaling, kernel.softcap).view(b, hq, c, seen)
        query_slot = s - q + start + torch.arange(c, device=queries.device)
        visible = slot[:seen].view(1, 1, 1, seen) <= query_slot.view(1, 1, c, 1)
        visible = visible & key_mask(key_valid[..., :seen], hq)
        probs = masked_softmax_(logits, visible, sink).mul_(query_valid[:, start : start + c].view(b, 1, c, 1))
        total[..., :seen] += probs.sum(2)
    return total
