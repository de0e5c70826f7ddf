"""R-KV: redundancy-aware KV cache compression for reasoning models (Cai et al., 2025): window-attention
importance minus key redundancy, per (layer, kv-head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.policies import select
from reasonkv.policies.attention import grouped_logits, grouped_sinks, masked_softmax_
from reasonkv.policies.base import Policy
from reasonkv.policies.common import WORKSPACE_ELEMENTS, pool1d
from reasonkv.policies.options import check_at_least, check_choice, check_option
from reasonkv.policies.registry import register

__all__ = ["RKV", "window_importance", "key_redundancy"]

_POOLINGS = ("max", "mean")
_RETAIN = ("last", "first", "none")


def window_importance(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    candidates: torch.Tensor,
    scaling: float,
    pooling: str = "max",
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """R-KV importance before smoothing: ``[rows, kv_heads, slots]``.

    The recorded recent ``queries`` ``[rows, query_heads, w, head_dim]`` (positions and validity
    ``[rows, w]``) against the stored ``keys`` ``[rows, kv_heads, slots, head_dim]`` at ``key_positions``:
    logits merged over each kv group by ``pooling`` (``"max"`` or ``"mean"``, before the softmax, as R-KV's
    ``compute_attention_scores``; sink logits alike), softmax over the ``candidates`` ``[rows, kv_heads,
    slots]`` a query sees (at or before its position; others score 0), mean over the valid queries.
    """
    b, w = query_positions.shape

    def merged(grouped: torch.Tensor) -> torch.Tensor:  # over the group axis
        return grouped.amax(2) if pooling == "max" else grouped.mean(2)

    logits = merged(grouped_logits(queries, keys, scaling, softcap))  # [rows, kv_heads, w, slots]
    if sinks is not None:
        sinks = merged(grouped_sinks(sinks, keys.shape[1]))  # [1, kv_heads, 1, 1]
    visible = candidates.unsqueeze(2) & (key_positions.unsqueeze(2) <= query_positions.view(b, 1, w, 1))
    visible &= query_valid.view(b, 1, w, 1)
    probs = masked_softmax_(logits, visible, sinks)
    count = query_valid.sum(-1).clamp(min=1).view(b, 1, 1)
    return probs.sum(2) / count


def key_redundancy(
    keys: torch.Tensor,
    valid: torch.Tensor,
    *,
    threshold: float = 0.5,
    retain: str = "last",
    duplicate_window: int | None = None,
    block: int = 128,
    chunk_elements: int = 1 << 20,
) -> torch.Tensor:
    """R-KV redundancy of every stored key: ``[rows, heads, slots]`` (a distribution over valid slots).

    ``S = cos(k_i, k_j)``, diagonal 0; for each token ``i`` the most recent ``j`` with ``S_ij > threshold``
    (``retain="last"``; ``"first"``: the oldest; ``"none"``: none) has ``S_ij`` set to 0, so of several
    near-duplicates the retained copy collects less redundancy. Redundancy is ``softmax_j(mean_i S_ij)`` over
    the real tokens (``valid`` ``[rows, slots]``; padding gets 0); slots are in position order.

    No ``slots x slots`` matrix: the column sums are ``u_j . sum_i u_i`` of the unit keys, and each row's
    duplicate is searched in blocks of keys (most recent first), doubling from ``block``, by the rows still
    without one (:func:`_duplicate_discount`), in ``O(chunk_elements)`` memory. ``duplicate_window`` searches
    only that many of the most recent keys (an approximation, for a bounded cost).
    """
    b, h, s, _ = keys.shape
    # In place on one float32 copy: a fresh buffer of this size costs the CPU more in page faults than the arithmetic.
    unit = keys.to(torch.float32, copy=True)
    unit.div_(unit.norm(dim=-1, keepdim=True) + 1e-8)
    unit.mul_(valid.view(b, 1, s, 1))  # padding takes no part, as a row or as a column
    column = torch.einsum("bhsd,bhd->bhs", unit, unit.sum(2)) - torch.linalg.vecdot(unit, unit)  # sum over i != j
    if retain != "none":
        reach = s if duplicate_window is None else min(s, duplicate_window)
        column = column - _duplicate_discount(unit, valid, threshold, retain == "last", reach, block, chunk_elements)
    count = valid.sum(-1).clamp(min=1).view(b, 1, 1)
    mean = (column / count).masked_fill(~valid.view(b, 1, s), float("-inf"))
    return mean.softmax(-1).nan_to_num(0.0)


def _duplicate_discount(
    unit: torch.Tensor, valid: torch.Tensor, threshold: float, last: bool, reach: int, block: int, chunk_elements: int
) -> torch.Tensor:
    """``[rows, heads, slots]``: per column ``j``, the sum of ``S_ij`` over the rows ``i`` whose discounted
    near-duplicate is ``j``, searched among the ``reach`` most recent (or oldest) keys. The first block is
    searched by every row; later ones by tiles of ``_TILE`` waiting rows of one head, so a head with many
    waiting rows (after 128 keys some have thousands, most a few dozen) costs no other head anything."""
    b, h, s, d = unit.shape
    heads = b * h
    flat = unit.reshape(heads, s, d)
    key_valid = valid.repeat_interleave(h, dim=0)  # [b * h, s]
    # Column s is scratch: rows that only pad a tile write their result there.
    pending = torch.cat([key_valid, key_valid.new_zeros((heads, 1))], dim=1)
    pick = torch.full((heads, s + 1), -1, dtype=torch.long, device=unit.device)
    pick_sim = unit.new_zeros((heads, s + 1))
    near, width = 0, block
    while near < reach:
        far = min(reach, near + width)
        lo, hi = (s - far, s - near) if last else (near, far)
        # Keys in the order of preference (the most recent first for "last"), so that the first match wins.
        keys = flat[:, lo:hi].flip(1) if last else flat[:, lo:hi]
        if threshold < 0:  # padding keys (zero vectors) would match a negative threshold
            valid_keys = key_valid[:, lo:hi].flip(1) if last else key_valid[:, lo:hi]
            keys = keys.masked_fill(~valid_keys.unsqueeze(-1), float("nan"))
        if near == 0:  # every row searches the first block: whole heads, in chunks of rows
            step = max(1, chunk_elements // max(1, heads * (hi - lo)))
            every_head = torch.arange(heads, device=unit.device).unsqueeze(1)
            for start in range(0, s, step):
                rows = torch.arange(start, min(s, start + step), device=unit.device).expand(heads, -1)
                sim = torch.bmm(flat[:, start : start + step], keys.transpose(1, 2))
                _settle(sim, every_head, rows, pending, pick, pick_sim, threshold, last, lo, hi)
        else:
            tiles = _waiting_tiles(pending[:, :s])
            if tiles is None:
                break
            tile_head, rows = tiles
            step = max(1, chunk_elements // max(1, (hi - lo) * (_TILE + d)))
            for start in range(0, tile_head.shape[0], step):
                head = tile_head[start : start + step]
                part = rows[start : start + step]
                queries = flat[head.unsqueeze(1), part.clamp(max=s - 1)]  # [tiles, _TILE, d]
                sim = torch.bmm(queries, keys.index_select(0, head).transpose(1, 2))
                _settle(sim, head.unsqueeze(1), part, pending, pick, pick_sim, threshold, last, lo, hi)
        near, width = far, 2 * width
    pick, pick_sim = pick[:, :s], pick_sim[:, :s]
    discount = unit.new_zeros((heads, s))
    discount.scatter_add_(1, pick.clamp(min=0), torch.where(pick >= 0, pick_sim, 0.0))
    return discount.view(b, h, s)


_TILE = 64  # waiting rows of one head searched together after the first block


def _waiting_tiles(pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows still waiting for a match, in tiles of ``_TILE`` rows of one head: ``(head [tiles], rows
    [tiles, _TILE])``, rows that only pad a tile set to ``slots`` (the scratch column); ``None`` when no
    row waits. The host reads one number (the tile count)."""
    heads, s = pending.shape
    counts = pending.sum(-1)
    per_head = (counts + _TILE - 1) // _TILE
    ends = per_head.cumsum(0)
    total = int(ends[-1])
    if total == 0:
        return None
    tile = torch.arange(total, device=pending.device)
    head = torch.searchsorted(ends, tile, right=True)
    rank = tile - (ends - per_head)[head]  # the tile's rank among its head's tiles
    waiting = torch.sort((~pending).to(torch.int8), dim=-1, stable=True).indices  # waiting rows first
    column = rank.unsqueeze(1) * _TILE + torch.arange(_TILE, device=pending.device)
    rows = waiting[head.unsqueeze(1), column.clamp(max=s - 1)]
    return head, torch.where(column < counts[head].unsqueeze(1), rows, s)


def _settle(
    sim: torch.Tensor,
    head: torch.Tensor,
    rows: torch.Tensor,
    pending: torch.Tensor,
    pick: torch.Tensor,
    pick_sim: torch.Tensor,
    threshold: float,
    last: bool,
    lo: int,
    hi: int,
) -> None:
    """Record the first match of each row in one block of keys. ``sim`` is ``[n, rows, keys]`` (keys in the
    order of preference), ``head`` ``[n, 1]`` and ``rows`` ``[n, rows]`` say whose similarities they are
    (row ``slots``: a scratch row); only rows still ``pending`` take a match."""
    own = (hi - 1 - rows) if last else (rows - lo)  # a row's own key (if in this block) never matches
    inside = (own >= 0) & (own < hi - lo)
    own = own.clamp(0, hi - lo - 1).unsqueeze(-1)
    sim.scatter_(-1, own, torch.where(inside.unsqueeze(-1), -2.0, sim.gather(-1, own)))
    hit, best = (sim > threshold).view(torch.uint8).max(-1)  # the first match in order of preference
    hit = hit.bool() & pending[head, rows]
    found = sim.gather(-1, best.unsqueeze(-1)).squeeze(-1)
    target = torch.where(hit, rows, pick.shape[1] - 1)  # rows without a match write to the scratch column
    pick[head, target] = (hi - 1 - best) if last else (lo + best)
    pick_sim[head, target] = found
    pending[head, target] = False


def _pieces(view, layers) -> list[list[tuple[int, slice]]]:
    """``layers``' kv heads in pieces of at most ``WORKSPACE_ELEMENTS`` keys (at least one head each), in
    order: ``[(layer, heads), ...]`` per piece."""
    rows, slots = view.valid.shape
    pieces, current, size = [], [], 0
    for layer in layers:
        heads, dim = view.info.num_kv_heads, view.info.head_dim
        per_head = rows * slots * dim
        step = max(1, WORKSPACE_ELEMENTS // per_head)
        for start in range(0, heads, step):
            count = min(step, heads - start)
            if current and size + count * per_head > WORKSPACE_ELEMENTS:
                pieces.append(current)
                current, size = [], 0
            current.append((layer, slice(start, start + count)))
            size += count * per_head
    return pieces + [current] if current else pieces


@register
@dataclass
class RKV(Policy):
    """R-KV (Cai et al., 2025): keep important, non-redundant tokens, per (layer, kv-head).

    ``score = mix_lambda * importance - (1 - mix_lambda) * redundancy`` (higher = keep), then the
    protected tokens plus the top-scoring others fill the budget.

    Parameters
    ----------
    mix_lambda
        Weight of importance against redundancy. Default 0.1, the value the paper reports (the public code's default is
        0.07).
    query_window
        ``alpha`` in the paper: how many recent queries observe the cache. Default 8 (paper and code).
    window
        Protected recent tokens. Default 8 = ``query_window``: R-KV always keeps the observation
        window and scores only the tokens before it.
    kernel
        Max-pooling kernel along the cache applied to the importance. Default 7 (code).
    threshold
        Cosine similarity above which two keys count as near-duplicates. Default 0.5 (code).
    retain
        Which near-duplicate of each token has its similarity discounted: ``"last"`` (the most
        recent, the code's default, so the newest copy of a repeated passage is kept), ``"first"``
        or ``"none"``.
    pooling
        How the query heads of a GQA group are merged: ``"max"`` (code default) or ``"mean"`` of
        the logits.
    duplicate_window
        Search each token's near-duplicate among this many most recent keys only (default ``None``:
        all, exact). An approximation that bounds an eviction's cost whatever the keys: the exact
        search stops at each row's most recent near-duplicate, so it is ``O(slots^2)`` per head only
        for keys that have none; with 256 it stays ``O(256 slots)``. Rows whose only duplicates are
        older get no discount.

    Where paper and code leave room, and the one deviation: ``docs/policy-choices.md``.
    """

    name = "rkv"
    granularity = "head"
    chunk_exact = True
    summary = "R-KV: window-attention importance minus key-similarity redundancy, per head"
    paper = "https://arxiv.org/abs/2505.24133"

    window: int = 8
    mix_lambda: float = 0.1
    query_window: int = 8
    kernel: int = 7
    threshold: float = 0.5
    retain: str = "last"
    pooling: str = "max"
    duplicate_window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, "kernel", 1)
        check_option(self, "mix_lambda", 0 <= self.mix_lambda <= 1, "in [0, 1]")
        check_option(self, "threshold", -1 <= self.threshold <= 1, "a cosine similarity in [-1, 1]")
        check_choice(self, "retain", _RETAIN)
        check_choice(self, "pooling", _POOLINGS)
        window = self.duplicate_window
        check_option(self, "duplicate_window", window is None or window >= 1, "None or a positive integer")

    # -- the two terms, exposed for tests and analysis ------------------------------------------
    def importance(self, view) -> torch.Tensor:
        """Pooled window-attention importance, ``[rows, kv_heads, slots]``, over the candidates (valid keys
        outside the window; 0 elsewhere)."""
        queries, q_positions, q_valid = view.recent_queries()
        positions = view.positions()
        candidates = positions >= 0
        if self.window > 0:
            candidates &= positions <= (view.newest.view(-1, 1, 1) - self.window)
        candidates &= view.valid.unsqueeze(1)
        kernel = view.kernel()
        raw = window_importance(
            queries,
            q_positions,
            q_valid,
            view.keys(),
            view.positions(),
            candidates,
            kernel.scaling,
            self.pooling,
            softcap=kernel.softcap,
            sinks=kernel.sinks,
        )
        # Non-candidates hold 0, which never wins a max against attention weights; the mask keeps the
        # pooled values of the last candidates from spilling into the window.
        return pool1d(raw, self.kernel, "max") * candidates

    def redundancy(self, view, keys: torch.Tensor | None = None) -> torch.Tensor:
        """Key redundancy, ``[rows, kv_heads, slots]`` (a distribution over each head's real tokens), of the
        view's keys or of ``keys`` (several layers' heads at once)."""
        keys = view.keys() if keys is None else keys
        return key_redundancy(
            keys, view.valid, threshold=self.threshold, retain=self.retain, duplicate_window=self.duplicate_window
        )

    def score(self, view) -> torch.Tensor:
        return self._combine(self.importance(view), self.redundancy(view))

    def _combine(self, importance: torch.Tensor, redundancy: torch.Tensor) -> torch.Tensor:
        lam = float(self.mix_lambda)
        return lam * importance - (1.0 - lam) * redundancy

    def keep_layers(self, view) -> list[torch.Tensor]:
        """Every layer's kept set. The redundancy of many layers' keys is computed in one pass, in pieces of
        at most ``WORKSPACE_ELEMENTS`` keys (whole layers together, or a layer's kv heads apart), so an
        eviction never copies (and upcasts) more keys than that at once."""
        layers = view.info.full_layers
        redundancy: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        for piece in _pieces(view, layers):
            keys = torch.cat([view.keys(layer)[:, heads] for layer, heads in piece], dim=1)
            found = self.redundancy(view, keys)
            sizes = [heads.stop - heads.start for _, heads in piece]
            for (layer, _), part in zip(piece, found.split(sizes, 1), strict=True):
                redundancy[layer].append(part)
        kept = []
        for layer in layers:
            at = view.at(layer)
            scores = self._combine(self.importance(at), torch.cat(redundancy[layer], dim=1))
            kept.append(select.keep_top(scores, valid=at.valid_mask(), protected=at.protected(), k=at.budget))
        return kept
