"""LagKV: lag-relative information of the KV cache tells which tokens matter (Liang et al., 2025).

Attention-free: per (layer, kv-head), the stored tokens after the sinks are cut into chunks of ``lag``
tokens, each scored against the range of the chunk after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.options import check_at_least, check_option
from reasonkv.policies.registry import register

__all__ = ["LagKV", "lag_relative_scores"]


def _chunk_scores(states: torch.Tensor) -> torch.Tensor:
    """``[rows, heads, p, lag, dim]`` -> ``[rows, heads, p - 1, lag]``: chunk ``c`` scored against chunk ``c + 1``."""
    reference, current = states[:, :, 1:], states[:, :, :-1]
    low = reference.amin(3, keepdim=True)
    span = reference.amax(3, keepdim=True) - low
    flat = span <= 0  # a channel without spread in the reference carries no information
    normalised = torch.where(flat, 0.0, (current - low) / span.masked_fill(flat, 1.0))
    return normalised.std(-1).softmax(-1)


def lag_relative_scores(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    *,
    skip: int,
    lag: int,
    value_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LagKV scores of the stored tokens ``keys``/``values`` ``[rows, kv_heads, slots, dim]``.

    A row's real tokens (``valid`` ``[rows, slots]``), in slot order, are chunked after the first ``skip``
    (the sinks), so padding never shifts a chunk boundary; ``value_weight`` is the reference code's
    ``score_v_ratio``. Returns ``(scores, scored, rank)``: ``key score + value_weight * value score``
    ``[rows, kv_heads, slots]`` float32 (0 where not scored), the tokens of a chunk with a complete successor
    ``[rows, slots]``, and each scored token's rank within its chunk (0 = lowest, ``lag - 1`` = highest).
    """
    r, h, s, _ = keys.shape
    scores = keys.new_zeros((r, h, s), dtype=torch.float32)
    rank = torch.zeros_like(scores)
    scored = torch.zeros((r, s), dtype=torch.bool, device=keys.device)
    n = valid.sum(-1)
    lead = n.clamp(max=skip)
    chunks = (n - lead) // lag  # complete chunks per row
    # Chunks are laid out for the most a row of ``s`` slots can hold (known on the host: no device
    # read); a row's chunks past its own count are never scored (``ok`` below).
    p = max(0, (s - skip) // lag)
    if p < 2:
        return scores, scored, rank
    # Real tokens of each row in slot order, right-aligned (padding first), then the chunked span.
    order = torch.sort(valid.to(torch.int8), dim=-1, stable=True).indices
    offset = torch.arange(p * lag, device=keys.device)
    slots = order.gather(1, (s - n + lead).unsqueeze(1).add(offset).clamp(max=s - 1))  # [r, p * lag]

    def chunked(states: torch.Tensor) -> torch.Tensor:
        index = slots.view(r, 1, -1, 1).expand(-1, h, -1, states.shape[-1])
        return states.gather(2, index).float().view(r, h, p, lag, -1)

    raw = _chunk_scores(chunked(keys)) + value_weight * _chunk_scores(chunked(values))  # [r, h, p - 1, lag]
    within = raw.argsort(-1).argsort(-1).float()
    ok = torch.arange(p - 1, device=keys.device).view(1, -1) < (chunks - 1).view(-1, 1)  # [r, p - 1]
    ok = ok.repeat_interleave(lag, dim=1)
    target = torch.where(ok, slots[:, : (p - 1) * lag], s)  # slot s is a dump for unscored chunks
    index = target.unsqueeze(1).expand(-1, h, -1)
    for out, src in ((scores, raw), (rank, within)):
        buffer = out.new_zeros((r, h, s + 1))
        buffer.scatter_(2, index, src.reshape(r, h, -1))
        out.copy_(buffer[..., :s])
    flags = scored.new_zeros((r, s + 1))
    flags.scatter_(1, target, True)
    scored.copy_(flags[:, :s])
    return scores, scored, rank


@register
@dataclass
class LagKV(Policy):
    """LagKV (Liang et al., 2025): score tokens by their lag-relative key/value spread, per (layer, kv-head).

    Each chunk's keys (and values) are min-max normalised per channel by the *next* chunk's range; the std over
    channels, softmaxed within the chunk, is a token's key (value) score. The last full chunk and the
    unfinished remainder have no successor: they are the newest tokens and rank first.

    Parameters
    ----------
    lag
        Chunk length ``L``. Default 128: the setting of the paper's experiments, of the authors'
        README example and of kvpress (the authors' class default, 1024, targets long prompts).
    value_weight
        Weight of the value score against the key score. Default 1.0 (plain ``K + V``, the
        authors' ``score_v_ratio``).
    quota
        ``True`` (default): every scored chunk keeps the same number of tokens (within one), its
        best ones: the paper's per-partition top-k, carried to a global budget as kvpress does
        (scores become ranks within the chunk). ``False``: one global top-k over the raw scores
        (kvpress's ``cross_scoring``).

    Where the paper leaves room: ``docs/policy-choices.md``.
    """

    name = "lagkv"
    granularity = "head"
    chunk_exact = True
    summary = "LagKV: lag-relative key/value spread per chunk (attention-free), per head"
    paper = "https://arxiv.org/abs/2504.04704"

    lag: int = 128
    value_weight: float = 1.0
    quota: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, "lag", 2)
        check_option(self, "value_weight", self.value_weight >= 0, "a non-negative number")

    def score(self, view) -> torch.Tensor:
        raw, scored, rank = lag_relative_scores(
            view.keys(), view.values(), view.valid, skip=self.sinks, lag=self.lag, value_weight=self.value_weight
        )
        if self.quota:
            # Rank first (equal share per chunk), the raw score (in [0, 1) after scaling) breaks ties.
            value = rank + 0.5 * raw / (1.0 + float(self.value_weight))
            top = float(self.lag)
        else:
            value = raw
            top = 1.0 + float(self.value_weight)
        slots = raw.shape[-1]
        recency = torch.arange(slots, device=raw.device, dtype=torch.float32) / (slots + 1)
        unscored = top + 1.0 + recency.expand_as(raw)
        return torch.where(scored.unsqueeze(1), value, unscored)
