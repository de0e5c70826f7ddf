"""RaaS: evict the least recently *useful* tokens, keep the prompt (Hu et al., 2025)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.common import LayerHeadTable
from reasonkv.policies.contract import Needs, Step
from reasonkv.policies.options import check_choice, check_option
from reasonkv.policies.registry import register

_GROUP_REDUCTIONS = ("max", "mean")


@register
@dataclass
class RaaS(Policy):
    """Reasoning-aware attention sparsity: a timestamp per token, refreshed whenever it is attended.

    RaaS ("Efficient Long-Decoding Inference with Reasoning-Aware Attention Sparsity", Hu et al.,
    2025) observes that in long reasoning traces "milestone" tokens are attended for a while and
    then never again. It gives every token a timestamp, refreshes it to the current step whenever
    the token's attention from the current query exceeds a threshold ``alpha``, and when the cache
    is full evicts the tokens with the oldest timestamps (least recently useful: LRU). Prefill
    tokens are all kept, because the question keeps being consulted throughout the reasoning.
    The signal is each forward's newest-query row (``Needs.attention_last``), applied in the order the
    queries came; the timestamps live in a table indexed by logical position, per (layer, kv-head).

    Where the paper leaves room: ``docs/policy-choices.md``.

    Parameters
    ----------
    threshold
        Attention probability above which a token's timestamp is refreshed (default ``1e-4``; see
        above). Must be in ``[0, 1)``.
    group_reduce
        How the query heads of a kv group combine before thresholding: ``"max"`` (default) or
        ``"mean"``.
    protect_prompt
        Never evict prompt tokens (default True for RaaS, as in the paper; they count against ``K``).
    sinks
        The first ``sinks`` logical positions are never evicted (default 4, the project default;
        redundant while the prompt is protected).
    window
        The ``window`` most recent tokens are never evicted (default 0).
    """

    protect_prompt: bool = True
    threshold: float = 1e-4
    group_reduce: str = "max"

    name = "raas"
    granularity = "head"
    summary = "evict the least recently attended tokens (timestamps refreshed above a threshold); prompt kept"
    paper = "https://arxiv.org/abs/2502.11147"
    # Only the last query of a forward refreshes timestamps, so a chunk of n tokens is not the same
    # as n single steps (those refresh with every query).
    chunk_exact = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_option(self, "threshold", 0 <= self.threshold < 1, "a probability in [0, 1)")
        check_choice(self, "group_reduce", _GROUP_REDUCTIONS)
        # Last-useful step per token, [batch, full-attention layers, kv_heads, positions] (-1: not seen; set by reset).
        self.timestamps: LayerHeadTable | None = None

    def needs(self, info) -> Needs:
        return Needs(attention_last=True)

    def reset(self, info, batch: int, device: torch.device) -> None:
        self.timestamps = LayerHeadTable(info, batch, fill=-1.0, device=device)

    def observe(self, step: Step) -> None:
        arriving = step.input_positions  # [batch, q], -1 for padding
        # Unseen positions hold -1: arriving is a use, at the token's own position.
        self.timestamps.add(arriving, arriving.float()[:, None, None, :] + 1.0, bound=step.position_bound)

    def observe_attention(self, chunk) -> None:
        rows, kv_heads = chunk.rows, self.timestamps.kv_heads  # query heads grouped as repeat_kv orders them
        grouped = rows.view(rows.shape[0], kv_heads, rows.shape[1] // kv_heads, *rows.shape[2:])
        attention = grouped.amax(2) if self.group_reduce == "max" else grouped.mean(2)  # [batch, kv_heads, n, slots]
        now = chunk.query_positions.view(chunk.query_positions.shape[0], 1, -1, 1)  # -1: padding query
        # The last use of each key, [batch, kv_heads, slots]: the largest (position + 1) among the queries that
        # used it, minus 1 (-1: none; a padding query sits at -1, so it refreshes nothing). A product, not a
        # torch.where: this runs over every logged query and key, and the broadcasting where is 3x slower.
        latest = ((attention > self.threshold) * (now.float() + 1.0)).amax(2) - 1.0
        at, bound = (self.timestamps.row[chunk.layer],), chunk.position_bound
        stamps = self.timestamps.get(chunk.slot_positions, bound=bound, at=at)
        self.timestamps.set(chunk.slot_positions, torch.maximum(stamps, latest), bound=bound, at=at)

    def score(self, view) -> torch.Tensor:
        positions = view.positions()
        stamps = self.timestamps.lookup(view.rows, positions, self.timestamps.row[view.layer])
        # Lexicographic (timestamp, position) as exact ranks: no ties, so no dependence on slot order.
        key = ((stamps.long() + 1) << 32) + (positions + 1)
        return key.argsort(-1).argsort(-1).float()
