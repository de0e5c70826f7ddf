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

    How the signal is computed here: the attention row of every forward's newest query over the
    keys it saw (``Needs.attention_last``), recomputed from the recorded queries and the cached keys
    in one batched pass before the next eviction (the refreshes are applied in the order the
    queries came, which leaves the same timestamps as refreshing at every step); the model runs
    SDPA / FlashAttention and is never asked for attention weights. The timestamps live in a table
    indexed by logical position, per (layer, kv-head), so eviction never has to move them.

    Choices where the paper leaves room
    -----------------------------------
    - **Clock**: the "step" of a timestamp is the logical position of the newest query of that
      forward pass (a decode step's clock advances by one per token, like the paper's step count).
    - **Arrival**: a token's timestamp starts at its own position (being produced counts as a
      use, as when a page enters an LRU list); then every forward pass refreshes to the current
      step the timestamps of the stored tokens whose attention exceeds ``threshold``. At prefill
      the last prompt query's row does the refreshing (only the newest query of a forward counts).
    - **Threshold** ``threshold = 1e-4``: RaaS uses a fixed, small absolute attention probability
      ``alpha``. The exact value of the paper's experiments could not be re-checked when this was
      written; ``1e-4`` is the working default and should be confirmed against the paper before
      RaaS numbers are quoted. It is an option; a larger value makes refreshes rarer (closer to
      FIFO), a smaller one refreshes nearly every held token.
    - **Grouped-query attention** (``group_reduce = "max"``): a kv head is read by several query
      heads; a token counts as used if *any* of them attends to it above the threshold (evicting it
      would hurt that head). ``"mean"`` thresholds the group's mean attention instead.
    - **Granularity**: the paper's system version groups tokens into pages (16 tokens, Quest-style
      page scores) so that paged kernels can skip whole pages; the algorithm itself is per token,
      which is what this policy implements, per (layer, kv-head).
    - **Ties**: many tokens share a timestamp; among equal timestamps the more recently produced
      token is kept, so the kept set never depends on slot layout (batch padding).
    - **The prompt and the budget** (``protect_prompt = True``): as in the paper, no prompt token is
      ever evicted. The paper's budget ``L`` counts only decoded tokens, on top of the full prompt;
      here the budget ``K`` covers everything held, prompt included, so ``K = L + prompt length``
      reproduces a paper budget ``L`` and a prompt longer than ``K`` is an error. Set
      ``protect_prompt=False`` to let the prompt compete on timestamps like any other token.
    - **Hybrid models**: RaaS stamps a token when a layer's newest query attends to it in that
      layer's cache. Only full-attention layers are evicted, so the attention is recomputed and read
      in those layers only (their cache is what the scores rank); sliding-window and linear-
      attention layers keep their model's own rules. Learned attention sinks and logit soft-capping
      enter the recomputed softmax as in the model's kernel.

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

    Attributes
    ----------
    timestamps
        Last-useful step per token, a :class:`LayerHeadTable` ``[batch, full-attention layers, kv_heads, positions]``
        (-1 for positions not seen yet; set by :meth:`reset`).
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
        self.timestamps: LayerHeadTable | None = None

    def needs(self, info) -> Needs:
        return Needs(attention_last=True)

    def reset(self, info, batch: int, device: torch.device) -> None:
        self.timestamps = LayerHeadTable(info, batch, fill=-1.0, device=device)

    def _per_kv_head(self, attention: torch.Tensor) -> torch.Tensor:
        """``[batch, query_heads, n, slots] -> [batch, kv_heads, n, slots]``, following ``repeat_kv``'s head order."""
        b, hq = attention.shape[:2]
        kv_heads = self.timestamps.kv_heads
        grouped = attention.view(b, kv_heads, hq // kv_heads, *attention.shape[2:])
        return grouped.amax(2) if self.group_reduce == "max" else grouped.mean(2)

    def observe(self, step: Step) -> None:
        arriving = step.input_positions  # [batch, q], -1 for padding
        # Unseen positions hold -1: arriving is a use, at the token's own position.
        self.timestamps.add(arriving, arriving.float()[:, None, None, :] + 1.0, bound=step.position_bound)

    def observe_attention(self, chunk) -> None:
        attention = self._per_kv_head(chunk.rows)  # [batch, kv_heads, n, slots]
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
