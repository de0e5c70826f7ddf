"""TriAttention: score keys by the attention the average future query would pay them, from pre-RoPE query
centers and the keys' own frequency content; attention-free."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from reasonkv.policies import select
from reasonkv.policies.base import Policy
from reasonkv.policies.contract import ModelInfo, Needs, Step
from reasonkv.policies.options import check_at_least, check_choice
from reasonkv.policies.query_centers import CenterSums, QueryCenters, bundled_centers
from reasonkv.policies.registry import register
from reasonkv.policies.rotary import RotaryTables

__all__ = ["AGGREGATIONS", "SELECTIONS", "TriAttention", "geometric_offsets"]

AGGREGATIONS = ("mean", "max")
SELECTIONS = ("per-head", "per-layer-head")
STATS_SOURCES = ("prefill", "bundled")


def geometric_offsets(offset_max: int) -> torch.Tensor:
    """The future offsets ``1, 2, 4, ..., <= offset_max`` (float64)."""
    return torch.tensor([float(1 << i) for i in range(offset_max.bit_length())], dtype=torch.float64)


@register
@dataclass
class TriAttention(Policy):
    """TriAttention (Mao et al., 2026): keep, per kv head, the keys that the queries to come would attend
    to most, predicted from where pre-RoPE queries concentrate, without any attention matrix.

    In pre-RoPE space a head's queries cluster around a fixed center per channel pair ``f`` (``q̄_f``, a
    complex number), and a key ``k`` at logical position ``p`` meets a query at position ``t + o``
    with the logit ``Re Σ_f q_f conj(k_f) s_f² e^{i ω_f (t + o - p)}`` (``ω_f`` the pair's rotary
    frequency, ``s_f`` its scaling). The score of a key at eviction time ``t`` is the paper's
    trigonometric series averaged (``aggregation="mean"``) or maximised (``"max"``) over the offsets
    ``o = 1, 2, 4, ..., offset_max``::

        Σ_f |q̄_f| |k_f| s_f² cos(ω_f (t - p + o) + φ_f)  +  Σ_f (E|q_f| - |q̄_f|) |k_f| s_f²,   φ_f = arg(q̄_f conj(k_f))

    with ``k`` the pre-RoPE key and ``E|q_f|`` the queries' mean modulus. Scores are z-normalised per
    (layer, query head) over the candidate tokens (``normalize``), aggregated over the query heads of
    a kv group by their max, and (``selection="per-head"``, the authors' runs) averaged over the
    layers, so that each kv head keeps one token set in every layer.

    The statistics: a file written by ``reasonkv calibrate --centers`` (``stats=PATH``; refused when made
    for another model), the one the package ships for a bundled model (``stats="bundled"``), or, by default
    (``stats="prefill"``, with a warning), each row's own prompt: the queries of its first forward, rotated
    back to pre-RoPE space and averaged per (layer, head), noisier than the authors' offline calibration.

    The rotation is exact to undo (:mod:`reasonkv.policies.rotary`), and undoing it and re-rotating by
    ``t - p + o`` equals rotating the center forward by ``t + o`` against the post-RoPE key, which is what is
    computed; the mean over offsets collapses to one complex factor per pair (``mean_o e^{iω o}``), so the
    ``"mean"`` score costs one complex dot product per key and head.

    Parameters
    ----------
    stats
        ``"prefill"`` (default), ``"bundled"`` or the path of a query centers file.
    offset_max
        The largest future offset (default 65536, the authors' ``triattention_frequency_window``).
    aggregation
        ``"mean"`` (default, the authors' runs) or ``"max"`` over the offsets.
    normalize
        z-normalise each (layer, query head)'s scores over the candidates before aggregating (default
        True, the authors' runs).
    selection
        ``"per-head"`` (default): one kept set per kv head, shared by every layer (the mean over
        layers of the max over the group's query heads; the authors' ``per_head_pruning``).
        ``"per-layer-head"``: one per (layer, kv head) (``per_layer_perhead_pruning``).

    Where this follows the authors' code and where it deviates: ``docs/policy-choices.md``.
    """

    name: ClassVar[str] = "triattention"
    granularity: ClassVar[str] = "head"
    chunk_exact: ClassVar[bool] = True  # statistics from the first forward (the prompt) or a file
    summary: ClassVar[str] = "pre-RoPE query centers x key frequencies over future offsets (attention-free)"
    paper: ClassVar[str] = "https://arxiv.org/abs/2604.04921"

    stats: str = "prefill"
    offset_max: int = 65536
    aggregation: str = "mean"
    normalize: bool = True
    selection: str = "per-head"

    def __post_init__(self) -> None:
        if isinstance(self.stats, os.PathLike):
            self.stats = os.fspath(self.stats)
        super().__post_init__()
        check_at_least(self, "offset_max", 1)
        check_choice(self, "aggregation", AGGREGATIONS)
        check_choice(self, "selection", SELECTIONS)
        self._file = None if self.stats in STATS_SOURCES else QueryCenters.load(self.stats)
        self._state: _State | None = None

    def needs(self, info: ModelInfo) -> Needs:
        return Needs(queries=self.stats == "prefill")

    # -- state --------------------------------------------------------------------------------------
    def reset(self, info: ModelInfo, batch: int, device: torch.device) -> None:
        layers = info.full_layers
        tables = {layer: info.rotary_of(layer, self.name).tables(device) for layer in layers}
        offsets = geometric_offsets(self.offset_max).to(device)
        factors = {layer: _offset_factors(tables[layer], offsets) for layer in layers}
        state = _State(info=info, tables=tables, factors=factors)
        if self.stats == "prefill":
            warnings.warn(
                f"{self.name}: query centers come from each prompt's own queries (stats='prefill'), not from "
                "an offline calibration; pass -o stats=PATH (reasonkv calibrate --centers) or stats=bundled",
                stacklevel=2,
            )
            state.sums = CenterSums(batch, layers, info.num_heads, info.head_dim // 2, device)
        else:
            centers, where = (
                (self._file, self.stats) if self._file is not None else (bundled_centers(info, self.name)[0], "")
            )
            centers.check(info, self.name, where)
            mean, modulus = centers.at(layers)
            state.centers = (mean.unsqueeze(0).to(device), modulus.unsqueeze(0).to(device))
        self._state = state

    def observe_queries(self, layer: int, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        state = self._state
        if state is not None and state.sums is not None and not state.frozen:
            state.sums.add(layer, queries, positions, valid, state.tables[layer])

    def observe(self, step: Step) -> None:
        if self._state is not None:
            self._state.frozen = True  # the first forward's queries are the statistics

    # -- scores -------------------------------------------------------------------------------------
    def _centers(self, view) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q̄, E|q|)`` of the view's rows and layer, ``[rows or 1, heads, pairs]``."""
        state = self._state
        column = state.info.full_layers.index(view.layer)
        if state.sums is not None:
            mean, modulus = state.sums.means()
            rows = view.rows.to(mean.device)
            return mean[:, column].index_select(0, rows), modulus[:, column].index_select(0, rows)
        mean, modulus = state.centers
        return mean[:, column], modulus[:, column]

    def head_scores(self, view) -> torch.Tensor:
        """One layer's score of every stored key for every query head, ``[rows, heads, slots]`` (before the
        normalisation and the aggregation over the group)."""
        state = self._state
        if state is None:
            raise RuntimeError(f"{self.name}: no generation started (reset() not called)")
        tables = state.tables[view.layer]
        keys = tables.pairs(view.keys())  # [rows, kv_heads, slots, pairs], post-RoPE
        rows, kv_heads, slots, pairs = keys.shape
        mean, modulus = self._centers(view)
        # The center rotated to the position the next token takes: s q̄ e^{iωt}.
        ahead = mean * tables.phases(view.newest + 1).unsqueeze(1)
        group = ahead.shape[1] // kv_heads
        ahead = ahead.expand(rows, -1, -1).reshape(rows, kv_heads, group, pairs)
        factors = state.factors[view.layer]
        conj = keys.conj()
        if self.aggregation == "mean":
            base = torch.einsum("rkgf,rksf->rkgs", ahead * factors.mean(dim=-1), conj).real
        else:
            base = torch.einsum("rkgfo,rksf->rkgso", ahead.unsqueeze(-1) * factors, conj).real.amax(dim=-1)
        spread = ((modulus - mean.abs()) * tables.scale).expand(rows, -1, -1).reshape(rows, kv_heads, group, pairs)
        extra = torch.einsum("rkgf,rksf->rkgs", spread, keys.abs())
        return (base + extra).reshape(rows, kv_heads * group, slots)

    def layer_scores(self, view) -> torch.Tensor:
        """One layer's scores per kv head, ``[rows, kv_heads, slots]``: normalised, max over the group."""
        scores = self.head_scores(view)
        rows, heads, slots = scores.shape
        kv_heads = view.info.num_kv_heads
        scores = scores.view(rows, kv_heads, heads // kv_heads, slots)
        if self.normalize:
            candidates = (view.valid_mask() & ~view.protected()).unsqueeze(2).float()
            count = candidates.sum(-1, keepdim=True).clamp(min=1.0)
            mean = (scores * candidates).sum(-1, keepdim=True) / count
            std = (((scores - mean) ** 2 * candidates).sum(-1, keepdim=True) / count).sqrt().clamp(min=1e-6)
            scores = (scores - mean) / std
        return scores.amax(dim=2)

    def score(self, view) -> torch.Tensor:
        if self.selection != "per-head":
            return self.layer_scores(view)
        layers = view.info.full_layers  # per-head: the mean of the layers' scores
        return sum(self.layer_scores(view.at(layer)) for layer in layers) / len(layers)

    # -- one kept set for every layer (per-head selection) -------------------------------------------
    def layers_share_kept_set(self) -> str | None:
        if self.selection != "per-head":
            return None
        return (
            "selection='per-head' keeps one token set per kv head in every layer (-o selection=per-layer-head does not)"
        )

    def ranking_layers(self, view) -> list[torch.Tensor]:
        if self.selection != "per-head":
            return super().ranking_layers(view)
        first = view.at(view.info.full_layers[0])  # every layer holds the same tokens per kv head
        return [self.ranking(first)] * len(view.info.full_layers)

    def keep_layers(self, view) -> list[torch.Tensor]:
        if self.selection != "per-head":
            return super().keep_layers(view)
        kept = select.keep_ranked(self.ranking_layers(view)[0], k=view.budget)
        return [kept] * len(view.info.full_layers)


def _offset_factors(tables: RotaryTables, offsets: torch.Tensor) -> torch.Tensor:
    """``e^{i ω_f o}`` of every pair and offset, ``[pairs, offsets]`` complex64 (angles in float64)."""
    angles = tables.omega.double().unsqueeze(1) * offsets.unsqueeze(0)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


@dataclass
class _State:
    info: ModelInfo
    tables: dict[int, RotaryTables]  # full-attention layer -> its rotation
    factors: dict[int, torch.Tensor]  # full-attention layer -> e^{iωo} [pairs, offsets]
    sums: CenterSums | None = None  # stats="prefill": each row's first-forward queries
    centers: tuple[torch.Tensor, torch.Tensor] | None = None  # a file's (q̄, E|q|), [1, layers, heads, pairs]
    frozen: bool = False  # the first forward is over: its queries are the statistics
