"""Expected Attention: score keys by the attention that future queries are expected to pay them, from the
mean and covariance of recent queries; attention-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.options import check_at_least, check_choice, check_option
from reasonkv.policies.registry import register
from reasonkv.policies.rotary import RotaryTables

__all__ = ["QUERY_SPANS", "ExpectedAttention", "query_moments"]

QUERY_SPANS = ("since-eviction", "window")


def query_moments(
    queries: torch.Tensor, weight: torch.Tensor, covariance: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean ``[rows, heads, d]`` and population covariance ``[rows, heads, d, d]`` of ``queries
    [rows, heads, w, d]`` over the ``w`` axis, counting only queries of ``weight [rows, w]`` 1."""
    weight = weight.float().view(weight.shape[0], 1, -1, 1)
    count = weight.sum(dim=2).clamp(min=1.0)  # [rows, 1, 1]
    mean = (queries * weight).sum(dim=2) / count
    if not covariance:
        return mean, None
    centered = (queries - mean.unsqueeze(2)) * weight
    return mean, centered.transpose(-1, -2) @ centered / count.unsqueeze(-1)


@register
@dataclass
class ExpectedAttention(Policy):
    """Expected Attention (kvpress's ``ExpectedAttentionPress``, Devoto et al., 2025) at decode time: keep,
    per (layer, kv-head), the keys with the largest expected attention from the queries to come,
    weighted by their value norm.

    At every eviction, per layer and query head: the recent post-RoPE queries that ``query_span``
    picks are rotated back to pre-RoPE space with the model's own rotary tables at their positions
    (:mod:`reasonkv.policies.rotary`), giving their mean ``μ`` and population covariance ``Σ``. The
    average rotation ``R̄`` over the next ``n_future_positions`` positions (``t .. t + n - 1``, ``t``
    the position the next token takes) carries them to where future queries will be:
    ``μ' = R̄ μ``, ``Σ' = R̄ Σ R̄ᵀ``. A Gaussian query ``q ~ N(μ', Σ')`` gives each key ``k`` (post-RoPE,
    as cached) the expected unnormalised attention ``E[exp(q·k/√d)] = exp(k·μ'/√d + kᵀΣ'k/(2d))``;
    the softmax of these logits over the candidate keys, averaged over the query heads of each kv
    group, times ``‖v‖`` (``(score + epsilon) · ‖v‖``), is the score.

    Parameters
    ----------
    n_future_positions
        Future positions the rotation is averaged over (default 512, kvpress's).
    use_covariance
        Include the ``kᵀΣ'k/(2d)`` term (default True).
    use_vnorm
        Multiply by the value norm (default True).
    epsilon
        Added to the probabilities before the value norm (default 0).
    query_span
        The queries the statistics come from: "since-eviction" (default, kvpress's decoding buffer) or
        "window" (the last ``query_window`` across evictions). ``"since-eviction"``: the queries decoded since
        the row's previous eviction, the last ``query_window`` at most, less the oldest ``sinks``
        (``min(B, 256) - 4``, 124 at ``B = 128``; after prefill, the recorded ones as ``"window"``).
        ``"window"``: the last ``query_window``, those at positions ``>= sinks`` (the rule of the fidelity
        runs in ``docs/results/frontier``).
    query_window
        The most recent queries recorded (default 256, kvpress's buffer of hidden states).

    Where this follows kvpress 0.5.5 and where it deviates: ``docs/policy-choices.md``.
    """

    name: ClassVar[str] = "expected-attention"
    granularity: ClassVar[str] = "head"
    chunk_exact: ClassVar[bool] = True  # reads the recorded window of queries at eviction time only
    summary: ClassVar[str] = "expected attention of future queries (mean + covariance, averaged RoPE) x value norm"
    paper: ClassVar[str] = "https://arxiv.org/abs/2510.00636"

    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    query_span: str = "since-eviction"
    query_window: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, "n_future_positions", 1)
        check_option(self, "epsilon", self.epsilon >= 0, "a number >= 0")
        check_choice(self, "query_span", QUERY_SPANS)
        self.epsilon = float(self.epsilon)
        self._tables: dict[int, RotaryTables] = {}  # full-attention layer -> its rotation (set by reset)
        self._future: torch.Tensor | None = None  # the offsets 0 .. n - 1 of the future positions
        # Per row: the evictions seen, and the newest position at the latest one and at the one before it.
        self._seen = self._latest = self._previous = torch.empty(0, dtype=torch.long)

    def reset(self, info: ModelInfo, batch: int, device: torch.device) -> None:
        self._tables = {layer: info.rotary_of(layer, self.name).tables(device) for layer in info.full_layers}
        self._future = torch.arange(self.n_future_positions, device=device)
        self._seen, self._latest, self._previous = (torch.full((batch,), -1, device=device) for _ in range(3))

    def _previous_eviction(self, view) -> torch.Tensor:
        """The newest position of each row at its previous eviction, ``[rows]`` (-1: none). Every layer of
        one eviction asks; the first to ask for a row's new eviction moves its marks on (no host sync)."""
        rows = view.rows.to(self._seen.device)
        count = view.evictions_so_far.to(self._seen.device)
        latest = self._latest.index_select(0, rows)
        new = self._seen.index_select(0, rows) != count
        previous = torch.where(new, latest, self._previous.index_select(0, rows))
        self._previous.index_copy_(0, rows, previous)
        self._latest.index_copy_(0, rows, torch.where(new, view.newest.to(latest.device), latest))
        self._seen.index_copy_(0, rows, count)
        return previous

    def query_weights(self, view, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Which recorded queries ``[rows, w]`` (oldest first) the statistics count (see ``query_span``)."""
        window = valid & (positions >= self.sinks)
        if self.query_span == "window":
            return window
        previous = self._previous_eviction(view).to(positions.device)
        start = torch.maximum(previous, view.prompt_lengths.to(positions.device) - 1)
        since = valid & (positions > start.unsqueeze(1))
        since = since & (since.cumsum(dim=1) > self.sinks)  # less the oldest ``sinks``, as kvpress's buffer
        # An eviction right after prefill has no decoded query yet: the prompt's are the only ones.
        return torch.where(since.any(dim=1, keepdim=True), since, window)

    def score(self, view) -> torch.Tensor:
        tables = self._tables[view.layer]
        queries, positions, valid = view.recent_queries()  # [rows, heads, w, d], [rows, w], [rows, w]
        pre = tables.unrotate(queries, positions.unsqueeze(1))
        mean, cov = query_moments(pre, self.query_weights(view, positions, valid), self.use_covariance)
        # The average of the rotations to t .. t + n - 1, per pair: s e^{iωt} mean_j e^{iωj}.
        t = view.newest + 1
        average = tables.phases(t.unsqueeze(1) + self._future).mean(dim=1)  # [rows, pairs]
        keys = view.keys().float()  # [rows, kv_heads, slots, d], post-RoPE
        rows, kv_heads, slots, d = keys.shape
        group = queries.shape[1] // kv_heads
        grouped = keys.unsqueeze(2)  # [rows, kv_heads, 1, slots, d]
        # k·(R̄μ) = (R̄ᵀk)·μ: rotate the keys by the transposed average (its conjugate, per pair).
        back = tables.channels(tables.pairs(grouped) * average.conj().view(rows, 1, 1, 1, -1))
        mean = mean.view(rows, kv_heads, group, 1, d)
        logits = (back * mean).sum(-1) / math.sqrt(d)  # [rows, kv_heads, group, slots]
        if cov is not None:
            spread = back @ cov.view(rows, kv_heads, group, d, d)
            logits = logits + (spread * back).sum(-1) / (2 * d)
        candidates = (view.valid_mask() & ~view.protected()).unsqueeze(2)
        probs = torch.softmax(logits.masked_fill(~candidates, float("-inf")), dim=-1).nan_to_num(0.0)
        scores = probs.mean(2)  # over each kv group's query heads
        if self.use_vnorm:
            scores = (scores + self.epsilon) * view.values().float().norm(dim=-1)
        return scores
