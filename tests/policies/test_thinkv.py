"""ThinKV: sparsity measure, KDE thresholds, segment typing on planted attention traces, and TBE's
eviction order, each against a reference written out from the rules in plain Python."""

from __future__ import annotations

import math
import random
import statistics
from types import SimpleNamespace

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from oracle import run_and_check
from reasonkv.policies import select
from reasonkv.policies.contract import AttentionChunk, ModelInfo, Step
from reasonkv.policies.thinkv import THOUGHT_TYPES, ThinKV, attention_sparsity, kde_thresholds, tertile_thresholds

INFO = ModelInfo(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
PROMPTS = (6, 4)  # real prompt tokens of row 0 and row 1 (row 1 is left-padded by 2)
R, E, T = (THOUGHT_TYPES.index(t) for t in ("reasoning", "execution", "transition"))


# ---------------------------------------------------------------- references written from the rules
def ref_sparsity(weights: list[float], threshold: float = 0.01) -> float:
    peak = max(weights)
    return sum(w < threshold * peak for w in weights) / len(weights)


def ref_kde_thresholds(samples: list[float], points: int = 201) -> tuple[float, float] | None:
    """Binned Gaussian KDE, Silverman bandwidth, the lowest point between the three highest modes."""
    xs = [v for v in samples if not math.isnan(v)]
    if len(xs) < 3:
        return None
    step = 1.0 / (points - 1)
    grid = [i / (points - 1) for i in range(points)]
    hist = [0] * points
    for v in xs:
        hist[round(min(max(v, 0.0), 1.0) / step)] += 1
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    std = statistics.stdev(xs)
    spread = min(std, (q3 - q1) / 1.34)
    spread = spread if spread > 0 else std
    h = max(0.9 * spread * len(xs) ** -0.2, step)
    density = [sum(c * math.exp(-0.5 * ((g - grid[b]) / h) ** 2) for b, c in enumerate(hist) if c) for g in grid]
    top = max(density)
    modes = []
    for i, d in enumerate(density):
        left = density[i - 1] if i > 0 else -math.inf
        right = density[i + 1] if i + 1 < points else -math.inf
        if d > left and d >= right and d >= 0.01 * top and d > 0:
            modes.append(i)
    if len(modes) < 3:
        return None
    best = sorted(sorted(modes, key=lambda i: -density[i])[:3])
    out = []
    for a, b in zip(best[:-1], best[1:], strict=True):
        inner = range(a + 1, b)
        out.append(grid[min(inner, key=lambda i: (density[i], i))])
    return out[0], out[1]


def ref_tertiles(samples: list[float]) -> tuple[float, float] | None:
    xs = [v for v in samples if not math.isnan(v)]
    if len(xs) < 3:
        return None
    return tuple(statistics.quantiles(xs, n=3, method="inclusive"))


def ref_level(s: float, thresholds) -> int:
    if thresholds is None:
        return 1
    return int(s >= thresholds[0]) + int(s >= thresholds[1])


def ref_kmeans_representatives(vectors: list[list[float]], k: int, iters: int) -> list[int]:
    """Indices (into ``vectors``, in time order) of the K-means representatives, ties to the first."""
    m, dim = len(vectors), len(vectors[0])
    center = [sum(v[j] for v in vectors) / m for j in range(dim)]
    xs = [[v[j] - center[j] for j in range(dim)] for v in vectors]
    tol = 1e-5 * sum(sum(a * a for a in x) for x in xs) / m

    def d2(a, b):
        return sum((p - q) ** 2 for p, q in zip(a, b, strict=True))

    def first_near_min(values):
        lowest = min(values)
        return next(i for i, v in enumerate(values) if v <= lowest + tol)

    centroids = [list(xs[int((i + 0.5) * m / k)]) for i in range(k)]
    for _ in range(iters):
        assign = [first_near_min([d2(x, c) for c in centroids]) for x in xs]
        for c in range(k):
            members = [x for x, a in zip(xs, assign, strict=True) if a == c]
            if members:
                centroids[c] = [sum(x[j] for x in members) / len(members) for j in range(dim)]
    assign = [first_near_min([d2(x, c) for c in centroids]) for x in xs]
    reps = []
    for c in range(k):
        members = [i for i in range(m) if assign[i] == c]
        if members:
            dists = [d2(xs[i], centroids[c]) for i in members]
            reps.append(members[first_near_min(dists)])
    return sorted(reps)


def ref_eviction_order(positions, prompt, types, keys, *, refresh, retention, iters, importance, trigger):
    """Positions of one row, first evicted first: stage, group, retention depth, position."""
    newest = max(positions)
    current = (newest - prompt) // refresh if newest >= prompt else -1
    groups: dict[tuple[str, int], list[int]] = {}
    for p in sorted(positions):
        group = ("gen", (p - prompt) // refresh) if p >= prompt else ("prompt", p // refresh)
        groups.setdefault(group, []).append(p)
    depth = {}
    for members in groups.values():
        alive = list(members)
        for p in members:
            depth[p] = 0
        for size in retention:
            if len(alive) > size:
                alive = [alive[i] for i in ref_kmeans_representatives([keys[p] for p in alive], size, iters)]
            for p in alive:
                depth[p] += 1
    rank = {t: len(THOUGHT_TYPES) - 1 - importance.index(t) for t in THOUGHT_TYPES}
    levels = len(retention)

    def key(p):
        if p < prompt:
            chunk = p // refresh
            return (2 if depth[p] < levels else 4, (1, 0, chunk), depth[p], p)
        s = (p - prompt) // refresh
        if s == current:
            return (3 if depth[p] < levels else 4, (2, 0, 0), depth[p], p)
        demotions = sum(1 for t in range(s + 1, current + 1) if trigger is not None and types[t] == trigger)
        cap = min(demotions, levels)
        stage = 0 if depth[p] < cap else (1 if depth[p] < levels else 4)
        return (stage, (0, rank[types[s]], s), depth[p], p)

    return sorted(positions, key=key)


# ---------------------------------------------------------------- a planted attention trace
def _row(fraction: float, n: int) -> list[float]:
    """An attention row over ``n`` real keys with ``round(fraction * (n - 1))`` near-zero weights."""
    small = round(fraction * (n - 1))
    return [1e-5] * small + [1.0] * (n - small)


def _run_trace(policy: ThinKV, fractions: list[list[float]], layer_fractions: dict[int, float] | None = None):
    """Prefill, then one decode step per entry of ``fractions`` (one planted sparsity per row).

    Returns the slot positions after the last step and the sparsity of every step per row.
    """
    policy.reset(INFO, 2, torch.device("cpu"))
    pad = max(PROMPTS) - min(PROMPTS)
    positions = torch.tensor([list(range(PROMPTS[0])), [-1] * pad + list(range(PROMPTS[1]))])
    step = Step(input_valid=positions >= 0, input_positions=positions, position_bound=max(PROMPTS))
    uniform = (positions >= 0).float() / (positions >= 0).sum(-1, keepdim=True)
    _observe(policy, step, positions, [uniform] * INFO.num_layers)
    measured = [[], []]
    for per_row in fractions:
        newest = positions.amax(-1, keepdim=True) + 1
        positions = torch.cat([positions, newest], dim=1)
        valid = positions >= 0
        step = Step(
            input_valid=torch.ones(2, 1, dtype=torch.bool), input_positions=newest, position_bound=int(newest.max()) + 1
        )
        layer_rows = []
        for layer in range(INFO.num_layers):
            rows = torch.zeros(2, positions.shape[1])
            for r, fraction in enumerate(per_row):
                fraction = (layer_fractions or {}).get(layer, fraction)
                weights = torch.tensor(_row(fraction, int(valid[r].sum())))
                rows[r, valid[r]] = weights / weights.sum()
            layer_rows.append(rows)
        for r, fraction in enumerate(per_row):
            measured[r].append(ref_sparsity(_row(fraction, int(valid[r].sum()))))
        _observe(policy, step, positions, layer_rows)
    return positions, measured


def _observe(policy: ThinKV, step: Step, positions: torch.Tensor, layer_rows: list[torch.Tensor]) -> None:
    """Hand the policy one forward: its step, then each layer's newest-query row ``[2, slots]``."""
    policy.observe(step)
    for layer, rows in enumerate(layer_rows):
        chunk = AttentionChunk(
            layer=layer,
            slot_positions=positions.unsqueeze(1),
            query_positions=step.input_positions[:, -1:].masked_fill(~step.input_valid[:, -1:], -1),
            visible=(positions >= 0).unsqueeze(1),
            position_bound=step.position_bound,
            rows=rows.view(2, 1, 1, -1).expand(-1, 2, -1, -1),
        )
        policy.observe_attention(chunk)


def _expected_types(measured: list[float], refresh: int, thresholds) -> list[int]:
    """Type of each generated token: its segment's type, decided at the segment's first step."""
    order = ("execution", "reasoning", "transition")
    types, current = [], None
    for g, s in enumerate(measured):
        if g % refresh == 0:
            history = measured[: g + 1]
            levels = thresholds if thresholds is not None else (ref_kde_thresholds(history) or ref_tertiles(history))
            current = THOUGHT_TYPES.index(order[ref_level(s, levels)])
        types.append(current)
    return types


# ---------------------------------------------------------------- tests
def test_sparsity_counts_near_zero_weights_of_real_keys():
    generator = torch.Generator().manual_seed(0)
    rows = torch.rand(3, 4, 9, generator=generator) ** 6
    valid = torch.rand(3, 9, generator=generator) > 0.3
    got = attention_sparsity(rows, valid.unsqueeze(1), 0.05)
    for b in range(3):
        for h in range(4):
            weights = [float(rows[b, h, s]) for s in range(9) if valid[b, s]]
            assert got[b, h].item() == pytest.approx(ref_sparsity(weights, 0.05))


def test_sparsity_of_masked_softmax_rows_needs_no_mask_pass():
    """Rows that hold 0 where hidden (a masked softmax's) give the same sparsity counted from the mask alone."""
    generator = torch.Generator().manual_seed(1)
    visible = torch.rand(3, 1, 5, 9, generator=generator) > 0.4
    visible[0, 0, 0] = False  # a padding query: it sees nothing
    logits = torch.randn(3, 4, 5, 9, generator=generator) * 3
    rows = logits.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    exact = attention_sparsity(rows, visible, 0.05)
    fast = attention_sparsity(rows, visible, 0.05, hidden_are_zero=True)
    assert torch.equal(fast, exact)
    assert (exact[0, :, 0] == 0).all()


def test_kde_thresholds_follow_the_estimator_and_fall_between_planted_modes():
    rng = random.Random(4)
    trimodal = [rng.gauss(c, 0.04) for c in (0.15, 0.5, 0.85) for _ in range(40)]
    rng.shuffle(trimodal)
    unimodal = [rng.gauss(0.6, 0.05) for _ in range(90)]
    sparse = trimodal[:60]  # missing samples (NaN) are ignored
    bimodal = [rng.gauss(c, 0.01) for c in (0.2, 0.5) for _ in range(199)] + [0.98]  # + a bump below 1%
    few = [0.3]
    rows = [trimodal, unimodal, sparse, few, bimodal]
    samples = torch.tensor([r + [math.nan] * (len(bimodal) - len(r)) for r in rows])
    got = kde_thresholds(samples)
    assert torch.isnan(got[4]).all()  # the third bump is too small to be a mode
    for row in range(5):
        want = ref_kde_thresholds(samples[row].tolist())
        if want is None:
            assert torch.isnan(got[row]).all(), row
        else:
            assert got[row].tolist() == pytest.approx(list(want), abs=1e-6), row
    assert 0.15 < got[0, 0] < 0.5 < got[0, 1] < 0.85
    assert torch.isnan(got[1]).all() and torch.isnan(got[3]).all()
    tertiles = tertile_thresholds(samples)
    assert tertiles[1].tolist() == pytest.approx(ref_tertiles(samples[1].tolist()), abs=1e-6)
    assert torch.isnan(tertiles[3]).all()


@pytest.mark.parametrize("thresholds", [(0.3, 0.6), None], ids=["calibrated", "adaptive"])
def test_segments_are_typed_by_the_sparsity_at_their_first_step(thresholds):
    rng = random.Random(1)
    centres = (0.1, 0.45, 0.8)
    fractions = [[rng.choice(centres) + rng.uniform(-0.03, 0.03) for _ in range(2)] for _ in range(60)]
    policy = ThinKV(refresh=5, thresholds=thresholds)
    positions, measured = _run_trace(policy, fractions)
    types, segments = policy.segmentation(positions)
    history = policy.sparsity_history()
    used_kde = False
    for row, prompt in enumerate(PROMPTS):
        real = positions[row] >= 0
        generated = positions[row][real][prompt:]
        want = _expected_types(measured[row], 5, thresholds)
        assert types[row][real][prompt:].tolist() == want
        assert segments[row][real][prompt:].tolist() == [g // 5 for g in range(60)]
        assert (types[row][real][:prompt] == -1).all() and (segments[row][real][:prompt] == -1).all()
        assert history[row, generated].tolist() == pytest.approx(measured[row])
        assert torch.isnan(history[row, :prompt]).all()
        used_kde |= any(ref_kde_thresholds(measured[row][: g + 1]) is not None for g in range(0, 60, 5))
        assert len(set(want)) == 3
    assert used_kde or thresholds is not None  # the adaptive trace exercises the KDE path, not only tertiles


def test_sparsity_reads_only_the_chosen_layers():
    policy = ThinKV(refresh=1, thresholds=(0.3, 0.6), layers=(1,))
    positions, _ = _run_trace(policy, [[0.1, 0.1]] * 3, layer_fractions={0: 0.1, 1: 0.9})
    types, _ = policy.segmentation(positions[:, -3:])
    assert (types == T).all()  # layer 1 alone is sparse
    both = ThinKV(refresh=1, thresholds=(0.3, 0.6))
    positions, _ = _run_trace(both, [[0.1, 0.1]] * 3, layer_fractions={0: 0.1, 1: 0.9})
    types, _ = both.segmentation(positions[:, -3:])
    assert (types == R).all()  # the mean of ~0.1 and ~0.9 is in the middle band


# Segment types planted through the sparsity of each segment's first step (thresholds 0.3 / 0.6).
FRACTION = {E: 0.1, R: 0.45, T: 0.8}


def _typed_trace(policy: ThinKV, plan: list[list[int]], steps: int, refresh: int) -> torch.Tensor:
    fractions = [[FRACTION[row_plan[g // refresh]] for row_plan in plan] for g in range(steps)]
    positions, _ = _run_trace(policy, fractions)
    types, _ = policy.segmentation(positions)
    for row, prompt in enumerate(PROMPTS):
        real = types[row][positions[row] >= 0][prompt:]
        assert real.tolist() == [plan[row][g // refresh] for g in range(steps)]
    return positions


def _fake_view(positions: torch.Tensor, keys: list[torch.Tensor], budget: int, sinks: int):
    valid = positions >= 0
    newest = positions.amax(-1)
    return SimpleNamespace(
        rows=torch.arange(positions.shape[0]),
        budget=budget,
        valid=valid,
        valid_mask=lambda: valid,
        token_positions=lambda: positions,
        newest=newest,
        prompt_lengths=torch.tensor(PROMPTS),
        info=INFO,
        keys=lambda layer: keys[layer],
        protected=lambda: select.protected_mask(positions, sinks=sinks, window=0, newest=newest),
    )


def _with_holes(positions: torch.Tensor, drop) -> torch.Tensor:
    """Remove some positions (earlier evictions) and left-align the rows again."""
    rows = [[p for p in row.tolist() if p >= 0 and not drop(p)] for row in positions]
    width = max(map(len, rows))
    return torch.tensor([[-1] * (width - len(r)) + r for r in rows])


@pytest.mark.parametrize("trigger", ["transition", pytest.param(None, marks=pytest.mark.slow)])
def test_eviction_order_equals_the_tbe_reference(trigger):
    refresh, retention, iters, sinks = 8, (4, 2, 1), 3, 2
    plan = [[R, E, T, E, T], [T, R, R, T, E]]
    policy = ThinKV(
        refresh=refresh, retention=retention, thresholds=(0.3, 0.6), kmeans_iters=iters, sinks=sinks, trigger=trigger
    )
    positions = _typed_trace(policy, plan, 37, refresh)
    positions = _with_holes(positions, lambda p: p > 6 and (p * 7) % 5 == 0 and p < 30)
    generator = torch.Generator().manual_seed(5)
    keys = [torch.randn(2, 1, positions.shape[1], 4, generator=generator) for _ in range(INFO.num_layers)]
    real = positions >= 0
    references = []
    for row, prompt in enumerate(PROMPTS):
        row_positions = positions[row][real[row]].tolist()
        slot_of = {p: s for s, p in enumerate(positions[row].tolist()) if p >= 0}
        features = {
            p: keys[0][row, 0, slot_of[p]].tolist() + keys[1][row, 0, slot_of[p]].tolist() for p in row_positions
        }
        references.append(
            ref_eviction_order(
                row_positions,
                prompt,
                {s: THOUGHT_TYPES[t] for s, t in enumerate(plan[row])},
                features,
                refresh=refresh,
                retention=retention,
                iters=iters,
                importance=THOUGHT_TYPES,
                trigger=trigger,
            )
        )
    rank = policy.eviction_rank(_fake_view(positions, keys, 10, sinks))
    for row in range(2):
        slots = [s for s in rank[row].argsort().tolist() if real[row, s]]
        assert positions[row, slots].tolist() == references[row], row
    smallest = int(real.sum(-1).min())
    for budget in (sinks, 7, 15, 23, smallest - 1, smallest):
        kept = policy.keep(_fake_view(positions, keys, budget, sinks))
        for row in range(2):
            unprotected = [p for p in references[row] if p >= sinks]
            want = set(range(sinks)) | set(unprotected[len(unprotected) - (budget - sinks) :])
            assert set(positions[row, kept[row]].tolist()) == want, (row, budget)


def test_transitions_cap_earlier_segments_by_the_retention_schedule():
    refresh, retention = 8, (4, 2, 1)
    plan = [[R, E, T, R, T, E], [R, E, T, R, T, E]]
    policy = ThinKV(refresh=refresh, retention=retention, thresholds=(0.3, 0.6), kmeans_iters=0, sinks=0)
    positions = _typed_trace(policy, plan, 45, refresh)  # segments 0-4 complete, segment 5 holds 5 tokens
    keys = [torch.randn(2, 1, positions.shape[1], 4) for _ in range(INFO.num_layers)]
    # transitions after each segment: 0 -> 2, 1 -> 2, 2 -> 1, 3 -> 1, 4 -> 0 -> caps 2, 2, 4, 4, all
    caps = [2, 2, 4, 4, 8]
    budget = PROMPTS[0] + 5 + sum(caps)
    row = 0
    kept = policy.keep(_fake_view(positions, keys, budget, 0))[row]
    kept_positions = positions[row, kept].tolist()
    prompt = PROMPTS[row]
    counts = [sum(1 for p in kept_positions if p >= prompt and (p - prompt) // refresh == s) for s in range(6)]
    assert counts == [*caps, 5]
    assert set(range(prompt)) <= set(kept_positions)
    # without the trigger, scenario 2 alone: least important type first, oldest first, to the floor
    plain = ThinKV(refresh=refresh, retention=retention, thresholds=(0.3, 0.6), kmeans_iters=0, sinks=0, trigger=None)
    _typed_trace(plain, plan, 45, refresh)
    kept = plain.keep(_fake_view(positions, keys, budget, 0))[row]
    kept_positions = positions[row, kept].tolist()
    counts = [sum(1 for p in kept_positions if p >= prompt and (p - prompt) // refresh == s) for s in range(6)]
    sizes, excess = [8, 8, 8, 8, 8], 40 - sum(caps)
    rank = {T: 0, E: 1, R: 2}
    for s in sorted(range(5), key=lambda s: (rank[plan[row][s]], s)):
        cut = min(excess, sizes[s] - retention[-1])
        sizes[s] -= cut
        excess -= cut
    assert counts == [*sizes, 5]


def _dense_depths(policy: ThinKV, features, group, positions, n_groups):
    """Reference: every group padded to the longest one and clustered at every level (no buckets, no skips)."""
    from reasonkv.policies.thinkv import _kmeans_representatives

    width = int(torch.bincount(group, minlength=n_groups).max())
    x = torch.zeros(n_groups, width, features.shape[-1])
    active = torch.zeros(n_groups, width, dtype=torch.bool)
    where, ids, places = {}, group.tolist(), positions.tolist()
    for g in range(n_groups):
        members = sorted((places[i], i) for i in range(len(ids)) if ids[i] == g)
        for rank, (_, i) in enumerate(members):
            x[g, rank], active[g, rank], where[i] = features[i], True, (g, rank)
    count = active.sum(-1, keepdim=True).clamp(min=1)
    x = (x - x.sum(1, keepdim=True) / count.unsqueeze(-1)) * active.unsqueeze(-1)
    gram = torch.bmm(x, x.transpose(1, 2))
    depth = torch.zeros(n_groups, width, dtype=torch.long)
    for size in policy.retention:
        clustered = active.sum(-1, keepdim=True) > size
        active = torch.where(clustered, _kmeans_representatives(gram, active, size, policy.kmeans_iters), active)
        depth += active.long()
    return torch.tensor([int(depth[where[i]]) for i in range(len(ids))])


@pytest.mark.slow
def test_retention_depths_in_size_buckets_equal_clustering_every_group_at_full_width():
    """Groups of 1 to 130 members (several power-of-two buckets, levels skipped where nothing is clustered),
    members out of position order: the same depths as one dense pass over every group."""
    generator = torch.Generator().manual_seed(3)
    sizes = [1, 3, 4, 5, 9, 17, 40, 64, 65, 130, 2, 33]
    group = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    order = torch.randperm(len(group), generator=generator)
    group = group[order]  # ids in no particular order along the tokens
    positions = torch.randperm(len(group), generator=generator)
    features = torch.randn(len(group), 24, generator=generator) + 3.0 * torch.randn(len(group), 1, generator=generator)
    policy = ThinKV()
    # The features read in pieces of 8 columns, as an eviction reads every layer's keys in a bounded workspace.
    got = policy._retention_depths(lambda tokens: iter(features[tokens].split(8, 1)), group, positions, len(sizes))
    assert torch.equal(got, _dense_depths(policy, features, group, positions, len(sizes)))
    assert set(got.tolist()) == set(range(len(policy.retention) + 1))  # 130 > 64: some tokens stop at every level


def test_kmeans_keeps_one_token_per_planted_cluster():
    # one segment of 8 tokens whose keys form 4 tight pairs: a cap of 4 keeps one of each pair
    refresh = 8
    policy = ThinKV(refresh=refresh, retention=(4,), thresholds=(0.3, 0.6), sinks=0)
    positions = _typed_trace(policy, [[R, T], [R, T]], 9, refresh)  # segment 0 done, 1 is current
    slots = positions.shape[1]
    pairs = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0]])
    keys = []
    for _ in range(INFO.num_layers):
        k = torch.zeros(2, 1, slots, 4)
        for row, prompt in enumerate(PROMPTS):
            for g in range(8):
                slot = (positions[row] == prompt + g).nonzero().item()
                k[row, 0, slot] = pairs[[0, 1, 2, 3, 3, 2, 1, 0][g]] + 0.01 * g
        keys.append(k)
    for row, prompt in enumerate(PROMPTS):
        budget = prompt + 4 + 1  # the prompt, four representatives, the current token
        kept = set(positions[row, policy.keep(_fake_view(positions, keys, budget, 0))[row]].tolist())
        segment = sorted(p - prompt for p in kept if prompt <= p < prompt + 8)
        assert len(segment) == 4 and {[0, 1, 2, 3, 3, 2, 1, 0][g] for g in segment} == {0, 1, 2, 3}


@pytest.mark.slow
def test_on_a_model_logits_match_the_oracle_and_every_generated_token_is_typed():
    model = tiny_llama(kv_heads=2)
    prompt = [5 + (7 * i + i * i) % 83 for i in range(30)]
    cache = run_and_check(model, "thinkv", prompt, budget=24, buffer=6, steps=30, refresh=4, retention=(4, 2, 1))
    policy = cache.evictor.policy
    assert cache.evictions >= 4
    types, segments = policy.segmentation(torch.arange(60).unsqueeze(0))
    assert (types[0, :30] == -1).all() and (segments[0, :30] == -1).all()
    assert (types[0, 30:] >= 0).all()
    assert segments[0, 30:].tolist() == [g // 4 for g in range(30)]
    held = cache.positions(0)[0, 0].tolist()
    assert set(range(4)) <= set(held) and 59 in held


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sparsity_threshold": 0.0}, "sparsity_threshold must be a number in"),
        ({"thresholds": (0.8, 0.2)}, "thresholds must be None or"),
        ({"thresholds": 0.5}, r"thinkv: option thresholds=0.5: expected tuple\[float, float\] or None"),
        ({"refresh": 0}, "refresh must be a positive integer"),
        ({"retention": (4, 8)}, "retention must be a non-empty, strictly decreasing"),
        ({"retention": ()}, "retention must be a non-empty, strictly decreasing"),
        ({"importance": ("reasoning", "execution")}, r"option importance=\(.*\): expected tuple\[str, str, str\]"),
        ({"importance": ("reasoning", "execution", "wait")}, "importance must be an order of reasoning, execution"),
        ({"sparsity_order": ("reasoning", "reasoning", "transition")}, "sparsity_order must be an order of"),
        ({"trigger": "wait"}, "trigger must be None or one of"),
        ({"layers": ()}, "layers must be None or a non-empty tuple"),
        ({"cluster_layers": (-1,)}, "cluster_layers must be None or a non-empty tuple"),
        ({"kmeans_iters": -1}, "kmeans_iters must be a non-negative integer"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        reasonkv.get_policy("thinkv", **options)


def test_a_layer_beyond_the_model_is_a_clear_error():
    with pytest.raises(ValueError, match="layers: layer 7 out of range: the model has 2 layers"):
        ThinKV(layers=(7,)).reset(INFO, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="cluster_layers: layer 2 out of range"):
        ThinKV(cluster_layers=(0, 2)).reset(INFO, 1, torch.device("cpu"))


def test_defaults_follow_the_paper():
    policy = reasonkv.get_policy("thinkv")
    assert (policy.sparsity_threshold, policy.refresh, policy.retention) == (0.01, 128, (64, 32, 16, 8, 4))
    assert policy.importance == ("reasoning", "execution", "transition")
    assert policy.sparsity_order == ("execution", "reasoning", "transition")
    assert (policy.trigger, policy.thresholds, policy.window, policy.sinks) == ("transition", None, 0, 4)
    needs = policy.needs(None)
    assert needs.attention_last and not needs.query_window and not needs.attention_sum and not needs.hidden_layers
    assert ThinKV.granularity == "token" and not ThinKV.chunk_exact and not ThinKV.stochastic
    assert "2510.01290" in ThinKV.paper
