"""ThinKV: thought-adaptive KV cache eviction for reasoning models (Ramachandran et al., ICLR 2026): the
segmentation into typed thoughts, the retention schedule and the K-means that picks a segment's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reasonkv.policies import select
from reasonkv.policies.base import Policy
from reasonkv.policies.common import WORKSPACE_ELEMENTS, PositionTable
from reasonkv.policies.contract import Needs
from reasonkv.policies.options import check_at_least, check_option
from reasonkv.policies.registry import register

__all__ = ["ThinKV", "THOUGHT_TYPES", "attention_sparsity", "kde_thresholds", "tertile_thresholds"]

THOUGHT_TYPES = ("reasoning", "execution", "transition")
PAPER_RETENTION = (64, 32, 16, 8, 4)
KDE_POINTS = 201  # grid on [0, 1] for the density of the sparsity (step 0.005)
MODE_FLOOR = 0.01  # a local maximum counts as a mode only above this fraction of the highest one


def attention_sparsity(
    rows: torch.Tensor, visible: torch.Tensor, threshold: float, *, hidden_are_zero: bool = False
) -> torch.Tensor:
    """Fraction of near-zero weights in attention rows: ``[..., slots] -> [...]``.

    A weight is near zero when it is below ``threshold`` times the largest weight of its row
    (ThinKV §4.1 uses 1% of the row maximum). Only the keys the query saw (``visible``, broadcast
    against ``rows``) count. ``hidden_are_zero``: the rows hold 0 wherever not visible (a masked
    softmax's rows), so the hidden keys are counted from ``visible`` alone, without masking the rows.
    """
    if hidden_are_zero:  # a hidden 0 is below the threshold exactly when the row's peak is positive
        peak = rows.amax(-1, keepdim=True)
        hidden = (~visible).sum(-1)
        small = ((rows < threshold * peak).sum(-1) - hidden).clamp(min=0)
        return small.float() / (visible.shape[-1] - hidden).clamp(min=1).float()
    rows = rows.float().masked_fill(~visible, 0.0)
    peak = rows.amax(-1, keepdim=True)
    small = (rows < threshold * peak) & visible
    return small.sum(-1).float() / visible.sum(-1).clamp(min=1).float()


def kde_thresholds(samples: torch.Tensor, points: int = KDE_POINTS) -> torch.Tensor:
    """The two sparsity thresholds between the three modes of a kernel density estimate.

    ThinKV's offline calibration (§4.1): estimate the density of the per-step attention sparsity
    with a Gaussian kernel, and put a threshold at the lowest point between each pair of adjacent
    modes. ``samples`` is ``[rows, n]`` (NaN marks a missing sample); each row is estimated on
    its own. Returns ``[rows, 2]`` thresholds, NaN for a row whose density has fewer than three
    modes. Pool the samples of several calibration prompts (or average their thresholds, as the
    paper does over prompts and layers) to get a ``thresholds`` option.

    The details the paper does not give (binning, bandwidth, what counts as a mode) are in
    ``docs/policy-choices.md``.
    """
    x = samples.double()
    present = ~torch.isnan(x)
    values = x.nan_to_num(0.0).clamp(0.0, 1.0)
    n = present.sum(-1).double()
    step = 1.0 / (points - 1)
    grid = torch.linspace(0.0, 1.0, points, dtype=torch.float64, device=x.device)
    bins = torch.round(values / step).long()
    hist = torch.zeros((x.shape[0], points), dtype=torch.float64, device=x.device)
    hist.scatter_add_(1, bins, present.double())
    mean = (values * present).sum(-1) / n.clamp(min=1)
    var = (((values - mean.unsqueeze(1)) ** 2) * present).sum(-1) / (n - 1).clamp(min=1)
    std = var.sqrt()
    if x.shape[1] > 0:
        quartiles = torch.nanquantile(x, torch.arange(1, 4, 2, dtype=x.dtype, device=x.device) / 4, dim=-1)
        iqr = (quartiles[1] - quartiles[0]).nan_to_num(0.0)
    else:
        iqr = torch.zeros_like(std)
    spread = torch.minimum(std, iqr / 1.34)
    spread = torch.where(spread > 0, spread, std)
    bandwidth = (0.9 * spread * n.clamp(min=1) ** -0.2).clamp(min=step)
    offsets = (grid.view(1, points, 1) - grid.view(1, 1, points)) / bandwidth.view(-1, 1, 1)
    density = (torch.exp(-0.5 * offsets**2) * hist.unsqueeze(1)).sum(-1)  # [rows, points]
    left = F.pad(density, (1, 0), value=-math.inf)[:, :-1]
    right = F.pad(density, (0, 1), value=-math.inf)[:, 1:]
    floor = MODE_FLOOR * density.amax(-1, keepdim=True)
    mode = (density > left) & (density >= right) & (density >= floor) & (density > 0)
    height = density.masked_fill(~mode, -math.inf)
    top = torch.sort(height, dim=-1, descending=True, stable=True).indices[:, :3]
    top = torch.sort(top, dim=-1).values  # three highest modes, left to right
    index = torch.arange(points, device=x.device)
    out = []
    for a, b in ((0, 1), (1, 2)):
        between = (index.view(1, -1) > top[:, a : a + 1]) & (index.view(1, -1) < top[:, b : b + 1])
        out.append(grid[density.masked_fill(~between, math.inf).argmin(-1)])
    thresholds = torch.stack(out, dim=-1)
    ok = (mode.sum(-1) >= 3) & (n >= 3)
    return thresholds.masked_fill(~ok.unsqueeze(1), math.nan).to(samples.dtype)


def tertile_thresholds(samples: torch.Tensor) -> torch.Tensor:
    """The 1/3 and 2/3 quantiles (linear interpolation) of each row of ``samples`` ``[rows, n]``
    (NaN = missing): ``[rows, 2]``, NaN for rows with fewer than three samples."""
    n = (~torch.isnan(samples)).sum(-1)
    if samples.shape[1] == 0:
        return samples.new_full((samples.shape[0], 2), math.nan)
    q = torch.arange(1, 3, dtype=samples.dtype, device=samples.device) / 3  # [1/3, 2/3], made on the device
    thresholds = torch.nanquantile(samples, q, dim=-1).transpose(0, 1)
    return thresholds.masked_fill((n < 3).unsqueeze(1), math.nan)


TIE_TOLERANCE = 1e-5  # distances within this fraction of the group's spread count as ties


def _first_near_min(values: torch.Tensor, tolerance: torch.Tensor) -> torch.Tensor:
    """Index of the first entry (last dim) within ``tolerance`` of the minimum: ties that only float
    noise separates (a prompt decoded in a batch or alone) resolve to the first candidate."""
    lowest = values.min(-1, keepdim=True).values
    return (values <= lowest + tolerance).float().argmax(-1)


def _kmeans_representatives(gram: torch.Tensor, present: torch.Tensor, k: int, iters: int) -> torch.Tensor:
    """Batched K-means over the present members of each group, then one real token per cluster.

    ``gram`` ``[groups, members, members]`` holds the members' feature dot products, ``present``
    ``[groups, members]`` which members take part (a group with ``k`` or fewer present members
    gets a meaningless answer, which the caller ignores). Centroids start at ``k`` present members evenly
    spaced in order, then ``iters`` Lloyd steps (an empty cluster keeps its centroid). Returns the mask of
    the member nearest each non-empty cluster's centroid; ties (within ``TIE_TOLERANCE`` times the group's
    mean squared distance to its mean) go to the first centroid and the first (oldest) member.

    A centroid is kept as member weights ``W`` (``[groups, k, members]``), so every distance comes from the
    Gram matrix, ``|x_i - c_j|^2 = G_ii - 2 (G W^T)_ij + (W G W^T)_jj``: Lloyd's algorithm exactly, at
    ``O(members^2 k)`` per step.
    """
    groups, members, _ = gram.shape
    weight = present.float()
    count = present.sum(-1).clamp(min=1).float()
    # Centre on the present members' mean: the expanded distances stay accurate.
    mean_dot = (gram * weight.unsqueeze(1)).sum(-1) / count.unsqueeze(-1)  # [groups, members]
    grand = (mean_dot * weight).sum(-1) / count
    g = gram - mean_dot.unsqueeze(-1) - mean_dot.unsqueeze(-2) + grand.view(-1, 1, 1)
    g = g * (weight.unsqueeze(-1) * weight.unsqueeze(-2))
    norms = torch.diagonal(g, dim1=-2, dim2=-1)
    tolerance = (TIE_TOLERANCE * norms.sum(-1) / count).view(-1, 1, 1) + 1e-30
    rank = present.long().cumsum(-1) - 1
    target = ((torch.arange(k, device=g.device, dtype=torch.float64) + 0.5).view(1, -1) * count.view(-1, 1) / k).long()
    centroids = ((rank.unsqueeze(1) == target.unsqueeze(2)) & present.unsqueeze(1)).float()  # [groups, k, members]

    def distances(w: torch.Tensor) -> torch.Tensor:
        cross = torch.bmm(g, w.transpose(1, 2))  # [groups, members, k]
        spread = (torch.bmm(w, g) * w).sum(-1)  # [groups, k]
        return (norms.unsqueeze(-1) - 2.0 * cross + spread.unsqueeze(1)).clamp(min=0.0)

    for _ in range(iters):
        assign = _first_near_min(distances(centroids), tolerance)
        onehot = F.one_hot(assign, k).float() * weight.unsqueeze(-1)  # [groups, members, k]
        sizes = onehot.sum(1).unsqueeze(-1)  # [groups, k, 1]
        centroids = torch.where(sizes > 0, onehot.transpose(1, 2) / sizes.clamp(min=1.0), centroids)
    d2 = distances(centroids)
    assign = _first_near_min(d2, tolerance)
    own = d2.gather(-1, assign.unsqueeze(-1)).squeeze(-1)
    member_of = (assign.unsqueeze(1) == torch.arange(k, device=g.device).view(1, -1, 1)) & present.unsqueeze(1)
    candidate = own.unsqueeze(1).masked_fill(~member_of, math.inf)  # [groups, k, members]
    best = _first_near_min(candidate, tolerance)
    reps = torch.zeros((groups, members), dtype=torch.long, device=g.device)
    reps.scatter_add_(1, best, member_of.any(-1).long())
    return (reps > 0) & present


FeatureReader = Callable[[torch.Tensor], Iterator[torch.Tensor]]


def _key_features(view, layers, rows: torch.Tensor, slots: torch.Tensor) -> FeatureReader:
    """The K-means features of the tokens at ``(rows, slots)``: their keys in ``layers``, concatenated, read in
    pieces of at most ``WORKSPACE_ELEMENTS`` float32 numbers (a layer's kv heads split when one layer is more),
    ``[n, part]`` each, for the tokens (indices into ``rows``/``slots``) in the order asked."""

    def read(tokens: torch.Tensor) -> Iterator[torch.Tensor]:
        row, slot = rows[tokens], slots[tokens]
        for layer in layers:
            keys = view.keys(layer)  # [rows, kv_heads, slots, head_dim]: a view, or one layer's evicted rows
            heads, dim = keys.shape[1], keys.shape[3]
            step = max(1, WORKSPACE_ELEMENTS // max(1, tokens.numel() * dim))
            for head in range(0, heads, step):
                yield keys[row, head : head + step, slot].reshape(tokens.numel(), -1).float()

    return read


@register
@dataclass
class ThinKV(Policy):
    """ThinKV (Ramachandran et al., ICLR 2026): thought-typed segments, evicted by "Think Before you Evict".

    **Thought decomposition (§4.1).** The generated tokens are cut into segments of ``refresh`` tokens (τ).
    When a segment's first token is decoded, the attention row of that step's newest query gives the
    *sparsity*: the fraction of stored keys whose weight is below ``sparsity_threshold`` of the row maximum,
    averaged over query heads and ``layers``. Below the first threshold the segment is *execution*, between
    them *reasoning*, at or above the second *transition* (sparsity T > R > E). The prompt is not a thought.
    The per-step sparsity of every decoded token is kept, for the adaptive thresholds and for calibration.

    **Thresholds.** The paper calibrates them offline per model (the minima between the three modes of a KDE
    of the sparsity, :func:`kde_thresholds`; samples from :meth:`sparsity_history`); pass them as
    ``thresholds``. Without them the same estimator runs online on the row's own history at every refresh,
    falling back to the history's tertiles while the density has fewer than three modes, and to reasoning
    with fewer than three samples.

    **TBE (§4.3).** Importance is R > E > T. When a row reaches ``K + B`` and must shrink to ``K``: (1) every
    ``trigger`` segment demotes each earlier segment one step down ``retention``, and tokens above these
    caps go first; (2) then the oldest segment of the least important type is demoted step by step to the
    floor ``retention[-1]``, then the next, until the budget holds; (3) beyond the paper, the prompt in
    ``refresh``-token chunks, then the current segment, are demoted the same way, and last the floor tokens
    go in the same group order. A segment kept at ``c`` tokens keeps the real tokens nearest the ``c``
    K-means centroids of its post-RoPE keys (``cluster_layers`` concatenated), nested level by level. The
    paper's quantisation (TBQ) and its kernel are not reproduced; ``docs/policy-choices.md`` lists where
    this follows the paper and where it chooses.

    Parameters
    ----------
    sparsity_threshold
        A weight below this fraction of its row's maximum counts as near zero. Default 0.01 (§4.1).
    thresholds
        ``(low, high)`` sparsity thresholds calibrated offline for the model (execution below
        ``low``, transition at or above ``high``). Default ``None``: online, see above.
    layers
        Layers whose attention rows give the sparsity (default ``None``: all full-attention
        layers). The paper's are the 4 its calibration selects; full-attention layers only.
    refresh
        Segment length and type-refresh interval τ in tokens. Default 128 (§4.1; the paper's
        ablation, Figure 10c, finds it the best trade-off).
    retention
        TBE's retention schedule, strictly decreasing; its last entry is the per-segment floor
        (the paper keeps at least 4 tokens per segment: evicting a segment entirely made models
        loop). Default ``(64, 32, 16, 8, 4)``.
    importance
        Thought types from most to least important. Default ``("reasoning", "execution",
        "transition")`` (R > E > T).
    sparsity_order
        Thought type of the dense, middle and sparse levels. Default ``("execution", "reasoning",
        "transition")`` (sparsity T > R > E).
    trigger
        Thought type whose segments demote every earlier segment (scenario 1). Default
        ``"transition"``; ``None`` keeps only scenario 2.
    cluster_layers
        Layers whose keys feed the K-means (default ``None``: all full-attention layers,
        concatenated). They must be full-attention layers on a hybrid model.
    kmeans_iters
        Lloyd iterations per clustering (default 10; the paper does not say; 0 keeps evenly
        spaced tokens).
    """

    name = "thinkv"
    granularity = "token"
    chunk_exact = False
    summary = (
        "ThinKV: attention-sparsity thought segments; transitions demote older segments, K-means keeps representatives"
    )
    paper = "https://arxiv.org/abs/2510.01290"

    sparsity_threshold: float = 0.01
    thresholds: tuple[float, float] | None = None
    layers: tuple[int, ...] | None = None
    refresh: int = 128
    retention: tuple[int, ...] = PAPER_RETENTION
    importance: tuple[str, str, str] = THOUGHT_TYPES
    sparsity_order: tuple[str, str, str] = ("execution", "reasoning", "transition")
    trigger: str | None = "transition"
    cluster_layers: tuple[int, ...] | None = None
    kmeans_iters: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        check_option(self, "sparsity_threshold", 0 < self.sparsity_threshold < 1, "a number in (0, 1)")
        pair = self.thresholds
        low_high = pair is None or 0 <= pair[0] <= pair[1] <= 1
        check_option(self, "thresholds", low_high, "None or (low, high) with 0 <= low <= high <= 1")
        if pair is not None:
            self.thresholds = (float(pair[0]), float(pair[1]))
        for name in ("layers", "cluster_layers"):
            layers = getattr(self, name)
            indices = layers is None or (len(layers) > 0 and min(layers) >= 0)
            check_option(self, name, indices, "None or a non-empty tuple of layer indices (integers >= 0)")
            setattr(self, name, None if layers is None else tuple(sorted(set(layers))))
        check_at_least(self, "refresh", 1)
        r = self.retention
        decreasing = len(r) > 0 and min(r) >= 1 and all(a > b for a, b in zip(r[:-1], r[1:], strict=True))
        check_option(self, "retention", decreasing, "a non-empty, strictly decreasing tuple of positive integers")
        self.retention = tuple(r)
        for name in ("importance", "sparsity_order"):
            order = getattr(self, name)
            every_type_once = sorted(order) == sorted(THOUGHT_TYPES)
            check_option(self, name, every_type_once, f"an order of {', '.join(THOUGHT_TYPES)}, each exactly once")
            setattr(self, name, tuple(order))
        triggers = f"None or one of {', '.join(THOUGHT_TYPES)}"
        check_option(self, "trigger", self.trigger is None or self.trigger in THOUGHT_TYPES, triggers)
        check_at_least(self, "kmeans_iters", 0)

    def needs(self, info) -> Needs:
        return Needs(attention_last=True)

    # -- state -----------------------------------------------------------------------------------
    def reset(self, info, batch: int, device) -> None:
        for name in ("layers", "cluster_layers"):
            layers = getattr(self, name)
            if layers is not None and max(layers) >= info.num_layers:
                raise ValueError(
                    f"thinkv: {name}: layer {max(layers)} out of range: the model has {info.num_layers} layers"
                )
            other = [layer for layer in layers or () if layer not in info.full_layers]
            if other:
                raise ValueError(
                    f"thinkv: {name}: layers {other} are not full-attention layers; "
                    f"full-attention layers: {list(info.full_layers)}"
                )
        self._prompt: torch.Tensor | None = None
        self._previous: torch.Tensor | None = None
        self._chosen = list(self.layers or info.full_layers)
        self._types = PositionTable(batch, fill=-1.0, device=device)  # indexed by segment number
        self._sparsity = PositionTable(batch, fill=math.nan, device=device)  # indexed by position
        self._per_layer = PositionTable(batch, (len(self._chosen),), fill=math.nan, device=device)
        self._pending: list[torch.Tensor] = []  # query positions delivered but not settled yet
        self._bound = 0
        self._level_type = torch.tensor([THOUGHT_TYPES.index(t) for t in self.sparsity_order], device=device)
        # eviction order of the types: 0 = least important; index -1 (untyped) = most important
        rank = [len(THOUGHT_TYPES) - 1 - self.importance.index(t) for t in THOUGHT_TYPES]
        self._type_rank = torch.tensor([*rank, len(THOUGHT_TYPES) - 1], device=device)

    def observe(self, step) -> None:
        if self._prompt is None:  # the first forward is the prompt: not a thought
            self._prompt = step.input_valid.sum(-1)
            self._previous = self._prompt - 1  # each row's newest position already typed

    def observe_attention(self, chunk) -> None:
        chosen = self._chosen
        if chunk.layer not in chosen:
            return
        # Sparsity of each recorded query's row over the keys it saw, averaged over query heads.
        rows, visible = chunk.rows, chunk.visible.unsqueeze(1)
        sparsity = attention_sparsity(rows, visible, self.sparsity_threshold, hidden_are_zero=True).mean(1)
        self._bound = max(self._bound, chunk.position_bound)
        at = (chosen.index(chunk.layer),)
        self._per_layer.set(chunk.query_positions, sparsity, bound=chunk.position_bound, at=at)
        if chunk.layer == chosen[0]:
            self._pending.append(chunk.query_positions)

    def _settle(self) -> None:
        """Record the sparsity of the queries delivered since the last call and type the segments they
        start, in the order the queries came (a segment's type uses the sparsity history up to it)."""
        if not self._pending:
            return
        positions, self._pending = torch.cat(self._pending, dim=1), []  # [batch, n], -1: padding
        prompt = self._prompt.to(positions.device).unsqueeze(1)
        layers = self._per_layer.get(positions.unsqueeze(1), bound=self._bound)  # [batch, layers, n]
        sparsity = layers.mean(1)
        generated = positions - prompt
        decoded = (positions >= 0) & (generated >= 0)
        recorded = torch.where(decoded, positions, -1)
        # A forward's newest query types every segment that starts among that forward's tokens.
        previous = torch.cat([self._previous.to(positions.device).unsqueeze(1), positions[:, :-1]], dim=1)
        first = torch.div(previous - prompt, self.refresh, rounding_mode="floor") + 1
        last = torch.div(generated, self.refresh, rounding_mode="floor")
        starts = decoded & (last >= first)
        self._previous = torch.where(positions[:, -1] >= 0, positions[:, -1], self._previous.to(positions.device))
        done = 0
        for i, any_start in enumerate(starts.any(0).tolist()):
            if not any_start:
                continue
            self._sparsity.set(recorded[:, done : i + 1], sparsity[:, done : i + 1], bound=self._bound)
            done = i + 1
            kind = self._level_type[self._levels(sparsity[:, i], starts[:, i]).to(self._level_type.device)]
            for extra in range(int((last[:, i] - first[:, i]).max()) + 1):
                segment = first[:, i] + extra
                target = torch.where(starts[:, i] & (segment <= last[:, i]), segment, -1)
                self._types.set(target.unsqueeze(1), kind.unsqueeze(1).float(), bound=self._bound)
        self._sparsity.set(recorded[:, done:], sparsity[:, done:], bound=self._bound)

    def _levels(self, sparsity: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Sparsity level (0 dense, 1 middle, 2 sparse) of each row's newest query."""
        if self.thresholds is not None:
            thresholds = torch.tensor(self.thresholds, device=sparsity.device).expand(sparsity.shape[0], 2)
        else:
            history = self._sparsity.values.to(sparsity.device)
            thresholds = kde_thresholds(history)
            missing = torch.isnan(thresholds).any(-1, keepdim=True)
            thresholds = torch.where(missing, tertile_thresholds(history), thresholds)
        s = sparsity.to(thresholds.dtype)
        level = (s >= thresholds[:, 0]).long() + (s >= thresholds[:, 1]).long()
        undecided = torch.isnan(thresholds).any(-1) | ~active
        return level.masked_fill(undecided, 1)

    # -- inspection ------------------------------------------------------------------------------
    def segmentation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Thought type (index into ``THOUGHT_TYPES``; -1: prompt or not yet typed) and segment number
        (-1: prompt) of logical positions ``[batch, n]`` of every row of the batch."""
        self._settle()
        rows = torch.arange(positions.shape[0], device=self._types.data.device)
        positions = positions.to(rows.device)
        generated = positions - self._prompt.to(rows.device).unsqueeze(1)
        segments = torch.where(
            (positions >= 0) & (generated >= 0), generated.div(self.refresh, rounding_mode="floor"), -1
        )
        types = self._types.lookup(rows, segments).long()
        return types, segments

    def sparsity_history(self) -> torch.Tensor:
        """Per-position sparsity of every decoded step, ``[batch, positions]`` (NaN: prompt or none),
        the samples for :func:`kde_thresholds` calibration."""
        self._settle()
        return self._sparsity.values.clone()

    # -- eviction ----------------------------------------------------------------------------------
    def ranking(self, view) -> torch.Tensor:
        return select.rank_top(self.eviction_rank(view), valid=view.valid_mask(), protected=view.protected())

    def _retention_depths(
        self, features: FeatureReader, group: torch.Tensor, positions: torch.Tensor, n_groups: int
    ) -> torch.Tensor:
        """How many levels of ``retention`` each token survives, ``[n]``, clustering each group's present
        tokens (in position order) to ``retention[0]``, those representatives to ``retention[1]``, and so on.

        ``features(tokens)`` yields the tokens' features in pieces ``[n, part]`` (float32, tokens in the
        order given); ``group`` ``[n]`` (ids ``0 .. n_groups - 1``) and ``positions`` ``[n]``. Groups are
        clustered in buckets of similar size (power-of-two widths), so a group costs its own members
        squared, not the longest segment's: after many evictions most segments hold a few floor tokens.
        A bucket runs K-means only at levels where one of its groups has more members than the level
        keeps; its Gram matrix is summed over the pieces of features, so no more than one piece is held
        at once.
        """
        device, n = group.device, group.shape[0]
        counts = torch.zeros(n_groups, dtype=torch.long, device=device).scatter_add_(0, group, torch.ones_like(group))
        # Groups by size (a stable sort, the same on the host); tokens by their group's place there, then position.
        order = torch.sort(counts, stable=True).indices
        place = torch.empty_like(order).scatter_(0, order, torch.arange(n_groups, device=device))[group]
        tokens = torch.sort(positions, stable=True).indices
        tokens = tokens[torch.sort(place[tokens], stable=True).indices]
        place = place[tokens]
        ahead = counts[order].cumsum(0) - counts[order]  # tokens of the groups before each place
        rank = torch.arange(n, device=device) - ahead[place]  # member index within its group
        by_size = sorted(counts.tolist())  # the host reads the group sizes once
        depth = torch.zeros(n, dtype=torch.long, device=device)
        buckets = []  # (members, at, active, biggest) of the buckets that cluster
        first_group = first_token = 0
        while first_group < n_groups:
            width = 1 << max(0, by_size[first_group] - 1).bit_length()  # the bucket's power-of-two width
            last_group = first_group
            while last_group < n_groups and by_size[last_group] <= width:
                last_group += 1
            last_token = first_token + sum(by_size[first_group:last_group])
            biggest = by_size[last_group - 1]
            members = slice(first_token, last_token)
            if biggest <= self.retention[-1]:  # nothing to cluster: every token survives every level
                depth[members] = len(self.retention)
            else:
                at = (place[members] - first_group, rank[members])
                active = torch.zeros((last_group - first_group, width), dtype=torch.bool, device=device)
                active[at] = True
                buckets.append((members, at, active, biggest))
            first_group, first_token = last_group, last_token
        grams = [None] * len(buckets)  # every distance below comes from them
        for part in features(tokens) if buckets else ():
            for index, (members, at, active, _) in enumerate(buckets):
                x = part.new_zeros((*active.shape, part.shape[-1]))
                x[at] = part[members]
                count = active.sum(-1, keepdim=True).clamp(min=1)
                x.sub_(x.sum(1, keepdim=True) / count.unsqueeze(-1)).mul_(active.unsqueeze(-1))  # centred per group
                gram = torch.bmm(x, x.transpose(1, 2))
                grams[index] = gram if grams[index] is None else grams[index].add_(gram)
        for (members, at, active, biggest), gram in zip(buckets, grams, strict=True):
            levels = torch.zeros(active.shape, dtype=torch.long, device=device)
            for size in self.retention:
                if biggest > size:
                    clustered = active.sum(-1, keepdim=True) > size
                    kept = _kmeans_representatives(gram, active, size, self.kmeans_iters)
                    active = torch.where(clustered, kept, active)
                levels += active.long()
            depth[members] = levels[at]
        return torch.empty_like(depth).scatter_(0, tokens, depth)

    def eviction_rank(self, view) -> torch.Tensor:
        """Each slot's place in TBE's eviction order, ``[rows, slots]``: higher is evicted later."""
        self._settle()
        positions = view.token_positions()
        device = positions.device
        valid = view.valid.to(device) & (positions >= 0)
        n_rows, slots = positions.shape
        rows = view.rows.to(device)
        prompt = view.prompt_lengths.to(device)
        newest = view.newest.to(device)
        tau, levels = self.refresh, len(self.retention)

        generated = positions - prompt.unsqueeze(1)
        is_gen = valid & (generated >= 0)
        is_prompt = valid & ~is_gen
        segment = torch.where(is_gen, generated.clamp(min=0) // tau, -1)
        chunk = torch.where(is_prompt, positions.clamp(min=0) // tau, -1)
        current = torch.where(newest >= prompt, (newest - prompt).clamp(min=0) // tau, -1)

        # -- groups: prompt chunks and generated segments; a slot's group id grows along the valid slots
        local = torch.where(is_gen, 2 * segment + 1, 2 * chunk)
        span = int(local.clamp(min=0).max()) + 1  # padding's local index is negative
        key = (torch.arange(n_rows, device=device).unsqueeze(1) * span + local)[valid]
        _, group = torch.unique(key, return_inverse=True)
        n_groups = int(group.max()) + 1 if group.numel() else 0
        slot_depth = torch.zeros_like(positions)
        if n_groups:
            at = valid.flatten().nonzero().flatten()  # the valid slots (one host read, whatever the layers)
            features = _key_features(view, self.cluster_layers or view.info.full_layers, at // slots, at % slots)
            depths = self._retention_depths(features, group, positions.flatten()[at], n_groups)
            slot_depth.view(-1).index_copy_(0, at, depths)
        # -- scenario 1: each trigger segment demotes every earlier segment one retention step
        kinds = self._types.lookup(rows, segment).long().to(device)
        type_rank = self._type_rank.to(device)[kinds.masked_fill(kinds < 0, len(THOUGHT_TYPES))]
        width = int(current.max()) + 1 if self.trigger is not None else 0  # 0: nothing generated yet
        if width > 0:
            table = self._types.lookup(rows, torch.arange(width, device=device).expand(n_rows, -1)).long()
            fires = (table == THOUGHT_TYPES.index(self.trigger)) & (
                torch.arange(width, device=device).unsqueeze(0) <= current.unsqueeze(1)
            )
            after = fires.flip(-1).cumsum(-1).flip(-1) - fires.long()  # trigger segments strictly later
            demotions = after.gather(1, segment.clamp(min=0, max=width - 1))
        else:
            demotions = torch.zeros_like(positions)
        cap = demotions.clamp(max=levels)

        # -- the order: stage, then group, then retention depth, then position (older first)
        completed = is_gen & (segment < current.unsqueeze(1))
        is_current = is_gen & ~completed
        floor = slot_depth >= levels
        stage = torch.full_like(positions, -1)
        stage = torch.where(completed & (slot_depth < cap), 0, stage)
        stage = torch.where(completed & (slot_depth >= cap) & ~floor, 1, stage)
        stage = torch.where(is_prompt & ~floor, 2, stage)
        stage = torch.where(is_current & ~floor, 3, stage)
        stage = torch.where(valid & floor, 4, stage)
        big = span + 1
        group_key = torch.where(completed, type_rank * big + segment, 0)
        group_key = torch.where(is_prompt, (len(THOUGHT_TYPES) + 1) * big + chunk, group_key)
        group_key = torch.where(is_current, (len(THOUGHT_TYPES) + 2) * big, group_key)

        order = torch.arange(slots, device=device).expand(n_rows, slots)
        for sort_key in (positions, slot_depth, group_key, stage):  # least significant first
            index = torch.sort(sort_key.gather(1, order), dim=1, stable=True).indices
            order = order.gather(1, index)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(slots, device=device).expand(n_rows, slots))
        return rank.float()
