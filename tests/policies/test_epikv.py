"""EPIKV: every score variant against a plain-Python reference, causality, planted signals, the
positional-trend claim, attention-free running, calibration files, the oracle on a tiny model."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from oracle import run_and_check
from reasonkv.policies import get_policy, select
from reasonkv.policies.calibration import default_anatomy, load_calibration, scale_layer, write_calibration
from reasonkv.policies.contract import ModelInfo, Step
from reasonkv.policies.epikv import EPIKV, EPIKVLag

LAYERS = 6
DIM = 8
INFO = ModelInfo(num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=16)
LAYER_OPTIONS = dict(a=1, b=4, band_a=(0, 1, 2), band_b=(3, 5))  # layers 2 and 5 only in the bands
PROMPT = [5 + (11 * i) % 85 for i in range(37)]


# ---------------------------------------------------------------------------------------------- driving
def random_sequences(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """One ``[LAYERS, T, DIM]`` hidden-state sequence per row (random walks with varied step sizes)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        steps = torch.randn(LAYERS, length, DIM, generator=generator)
        scale = torch.rand(LAYERS, length, 1, generator=generator) * 3 + 0.1
        out.append((steps * scale).cumsum(1))
    return out


def sequences_from_signal(g: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Hidden states ``[LAYERS, T, DIM]`` whose successive distances are exactly ``g`` ``[LAYERS, T]``."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(LAYERS, g.shape[1], DIM, generator=generator, dtype=torch.float64)
    directions /= directions.norm(dim=-1, keepdim=True)
    steps = directions * g.double().unsqueeze(-1)
    steps[:, 0] = torch.randn(LAYERS, DIM, generator=generator, dtype=torch.float64)  # arbitrary start
    return steps.cumsum(1).float()


def feed(policy, sequences: list[torch.Tensor], prefill: list[int], chunks: list) -> list[int]:
    """Drive ``policy`` through ``reset``/``observe``: one left-padded prefill, then one step per entry
    of ``chunks``: ``n`` tokens for every row, or a tuple of per-row counts (left-padded to the
    longest; 0 = the row is all padding in that step). Padding carries huge garbage hidden states.
    Returns the tokens fed per row."""
    batch = len(sequences)
    policy.reset(INFO, batch, torch.device("cpu"))
    garbage = torch.Generator().manual_seed(99)

    def step(sizes: list[int], width: int) -> Step:
        valid = torch.zeros(batch, width, dtype=torch.bool)
        positions = torch.full((batch, width), -1)
        hidden = {layer: torch.randn(batch, width, DIM, generator=garbage) * 1e3 for layer in range(LAYERS)}
        for row, (start, size) in enumerate(sizes):
            valid[row, width - size :] = True
            positions[row, width - size :] = torch.arange(start, start + size)
            for layer in range(LAYERS):
                hidden[layer][row, width - size :] = sequences[row][layer, start : start + size]
        return Step(input_valid=valid, input_positions=positions, hidden=hidden)

    policy.observe(step([(0, p) for p in prefill], max(prefill)))
    seen = list(prefill)
    for sizes in chunks:
        sizes = list(sizes) if isinstance(sizes, tuple) else [sizes] * batch
        policy.observe(step(list(zip(seen, sizes, strict=True)), max(sizes)))
        seen = [s + n for s, n in zip(seen, sizes, strict=True)]
    return seen


class FakeView:
    """The part of ``EvictionView`` a token-granularity policy reads, over hand-made slots."""

    def __init__(self, policy, positions: torch.Tensor, budget: int):
        self.policy, self.budget = policy, budget
        self._positions = positions
        self.rows = torch.arange(positions.shape[0])
        self.valid = positions >= 0
        self.newest = positions.max(dim=1).values

    def token_positions(self) -> torch.Tensor:
        return self._positions

    def valid_mask(self) -> torch.Tensor:
        return self.valid

    def protected(self) -> torch.Tensor:
        p = self.policy
        return select.protected_mask(self._positions, sinks=p.sinks, window=p.window, newest=self.newest)


def slot_layout(seen: list[int], seed: int = 0) -> torch.Tensor:
    """Every position of every row in a shuffled slot order, rows left-padded with -1 (like the cache)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(seen) + 2
    positions = torch.full((len(seen), width), -1)
    for row, n in enumerate(seen):
        positions[row, width - n :] = torch.randperm(n, generator=generator)
    return positions


def scores_by_position(policy, seen: list[int]) -> list[list[float]]:
    """Eviction scores read through ``policy.score`` on a fake view, rearranged by logical position."""
    positions = slot_layout(seen)
    scores = policy.score(FakeView(policy, positions, budget=4))
    out = []
    for row, n in enumerate(seen):
        by_position = [math.nan] * n
        for slot in range(positions.shape[1]):
            p = int(positions[row, slot])
            if p >= 0:
                by_position[p] = float(scores[row, slot])
        out.append(by_position)
    return out


# ---------------------------------------------------------------------------------------------- reference
def ref_g(sequence: torch.Tensor, layer: int) -> list[float | None]:
    h = sequence[layer].double().tolist()
    out: list[float | None] = [None]
    for t in range(1, len(h)):
        out.append(math.sqrt(sum((x - y) ** 2 for x, y in zip(h[t], h[t - 1], strict=True))))
    return out


def ref_stats(values: list[float | None]) -> tuple[int, float, float]:
    defined = [v for v in values if v is not None]
    if not defined:
        return 0, 0.0, 0.0
    mu = sum(defined) / len(defined)
    return len(defined), mu, math.sqrt(sum((v - mu) ** 2 for v in defined) / len(defined))


def ref_z(g: list[float | None], t: int, window: int, eps: float) -> float:
    if g[t] is None:
        return 0.0
    n, mu, sigma = ref_stats(g[max(0, t - window) : t])
    return 0.0 if n < 2 else (g[t] - mu) / (sigma + eps)


def ref_scores(sequence: torch.Tensor, opts: dict) -> list[float | None]:
    """The formulas of METHODS.md, one token at a time. ``None``: a pending ``lag`` token."""
    variant, eps = opts["variant"], opts.get("eps", 1e-6)
    a, b = opts["a"], opts["b"]
    g = {layer: ref_g(sequence, layer) for layer in range(sequence.shape[0])}
    n = sequence.shape[1]
    out: list[float | None] = []
    for t in range(n):
        if variant == "raw":
            m = opts.get("smooth", 1)
            means = []
            for layer in (a, b):
                count, mu, _ = ref_stats(g[layer][max(0, t - m + 1) : t + 1])
                means.append(mu if count else None)
            out.append(0.0 if None in means else means[0] - means[1])
        elif variant in ("zscore", "band"):
            w = opts.get("stats_window", 128)
            band_a, band_b = (opts["band_a"], opts["band_b"]) if variant == "band" else ((a,), (b,))
            za = sum(ref_z(g[layer], t, w, eps) for layer in band_a) / len(band_a)
            zb = sum(ref_z(g[layer], t, w, eps) for layer in band_b) / len(band_b)
            out.append(za - zb)
        else:
            lag = opts["lag"]
            c = t // lag
            if (c + 2) * lag > n:
                out.append(None)
                continue
            zs = []
            for layer in (a, b):
                count, mu, sigma = ref_stats(g[layer][(c + 1) * lag : (c + 2) * lag])
                value = g[layer][t]
                zs.append(0.0 if value is None or count < 2 else (value - mu) / (sigma + eps))
            out.append(zs[0] - zs[1])
    return out


def assert_matches_reference(got: list[float], want: list[float | None], pending_value=None):
    assert len(got) == len(want)
    for t, (x, y) in enumerate(zip(got, want, strict=True)):
        if y is None:
            if pending_value is not None:
                assert x == pending_value(t), t
            continue
        assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4), f"position {t}: got {x}, want {y}"


VARIANT_CASES = {
    "raw": dict(variant="raw"),
    "raw-smooth3": dict(variant="raw", smooth=3),
    "zscore-default-window": dict(variant="zscore"),  # every window here is shorter than W = 128
    "zscore-w5": dict(variant="zscore", stats_window=5),
    "band-w6": dict(variant="band", stats_window=6),
    "lag4-neutral": dict(variant="lag", lag=4, pending="neutral"),
    "lag5-recent": dict(variant="lag", lag=5),
}


@pytest.mark.parametrize("case", sorted(VARIANT_CASES))
def test_scores_equal_the_reference(case):
    options = {**LAYER_OPTIONS, **VARIANT_CASES[case]}
    policy = get_policy("epikv", **options)
    # Row 1 is left-padded by 4 in the prefill, sits out a 1-token and a 2-token step (all padding) and
    # gets one token of a 3-token step (left-padded by 2). Row 2 is all padding in the prefill: its
    # first token arrives in a decode step, with no predecessor.
    prefill = [9, 5, 0]
    schedule = [1] * 10 + [(1, 0, 1)] + [1] * 3 + [(2, 0, 2), (3, 1, 1)] + [1] * 8
    sequences = random_sequences([36, 27, 25], seed=len(case))
    seen = feed(policy, sequences, prefill, schedule)
    assert seen == [36, 27, 25]
    got = scores_by_position(policy, seen)
    for row in range(3):
        want = ref_scores(sequences[row], options)
        first = policy.token_scores(torch.zeros(1, 1, dtype=torch.long), torch.tensor([row]))
        assert want[0] == 0.0 and first.item() == 0.0  # the first token is neutral
        if options["variant"] == "lag" and options.get("pending", "recent") == "recent":
            width = max(seen) + 2
            # pending tokens rank above every finalised one, newest first: key = slots + position
            pending = [t for t, w in enumerate(want) if w is None]
            assert [got[row][t] for t in pending] == [width + t for t in pending]
            finalised = [t for t, w in enumerate(want) if w is not None]
            ranked = sorted(finalised, key=lambda t: want[t])
            assert sorted(finalised, key=lambda t: got[row][t]) == ranked
            assert max(got[row][t] for t in finalised) < min(got[row][t] for t in pending)
            raw = policy.token_scores(torch.arange(seen[row]).unsqueeze(0), torch.tensor([row]))[0].tolist()
            assert_matches_reference(raw, want)
        else:
            assert_matches_reference(got[row], want, pending_value=lambda t: 0.0)


def test_token_scores_for_a_subset_of_rows_and_padding():
    policy = get_policy("epikv", **LAYER_OPTIONS, stats_window=4)
    sequences = random_sequences([12, 12, 12], seed=3)
    feed(policy, sequences, [12, 12, 12], [])
    positions = torch.tensor([[-1, 3, 7], [11, 0, -1]])
    got = policy.token_scores(positions, torch.tensor([2, 0]))
    want2, want0 = (ref_scores(sequences[r], {**LAYER_OPTIONS, "variant": "zscore", "stats_window": 4}) for r in (2, 0))
    assert math.isnan(got[0, 0]) and math.isnan(got[1, 2])
    for x, y in zip(got[0, 1:].tolist() + got[1, :2].tolist(), [want2[3], want2[7], want0[11], want0[0]], strict=True):
        assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("case", ["raw-smooth3", "zscore-w5", "band-w6", "lag4-neutral"])
def test_chunked_observation_equals_token_by_token(case):
    options = {**LAYER_OPTIONS, **VARIANT_CASES[case]}
    sequences = random_sequences([30, 30], seed=5)
    one = get_policy("epikv", **options)
    feed(one, sequences, [2, 2], [1] * 28)
    chunked = get_policy("epikv", **options)
    feed(chunked, sequences, [11, 11], [3, 1, 5, 8, 2])
    positions = torch.arange(30).expand(2, -1)
    torch.testing.assert_close(
        one.token_scores(positions), chunked.token_scores(positions), rtol=1e-5, atol=1e-5, equal_nan=True
    )


# ---------------------------------------------------------------------------------------------- causality
@pytest.mark.parametrize("case", ["raw", "raw-smooth3", "zscore-default-window", "zscore-w5", "band-w6"])
def test_appending_tokens_never_changes_an_earlier_score(case):
    policy = get_policy("epikv", **LAYER_OPTIONS, **VARIANT_CASES[case])
    sequences = random_sequences([40, 36], seed=11)
    feed(policy, [s[:, :20] for s in sequences], [8, 4], [1] * 12)
    positions = torch.tensor([list(range(20)), list(range(16)) + [-1] * 4])
    before = policy.token_scores(positions).clone()
    # same prefix, then a different and much wilder continuation
    wild = [torch.cat([s[:, :20], s[:, 20:] * 50.0], dim=1) for s in sequences]
    policy2 = get_policy("epikv", **LAYER_OPTIONS, **VARIANT_CASES[case])
    feed(policy2, wild, [8, 4], [1] * 32)
    assert torch.equal(before.nan_to_num(-7.0), policy2.token_scores(positions).nan_to_num(-7.0))
    feed(policy, sequences, [8, 4], [1] * 32)
    assert torch.equal(before.nan_to_num(-7.0), policy.token_scores(positions).nan_to_num(-7.0))


def test_lag_finalises_a_chunk_when_the_following_chunk_is_complete():
    lag = 4
    options = {**LAYER_OPTIONS, "variant": "lag", "lag": lag}
    sequence = random_sequences([40], seed=2)[0]
    policy = get_policy("epikv-lag", **options)
    history = []
    seen = feed(policy, [sequence[:, :3]], [3], [])
    for _ in range(37):
        seen = [seen[0] + 1]
        # feed one more token by re-driving the tail: observe a single-token step
        policy.observe(
            Step(
                input_valid=torch.ones(1, 1, dtype=torch.bool),
                input_positions=torch.tensor([[seen[0] - 1]]),
                hidden={layer: sequence[layer, seen[0] - 1].view(1, 1, DIM) for layer in range(LAYERS)},
            )
        )
        history.append(policy.token_scores(torch.arange(40).unsqueeze(0))[0].clone())
    for n, scores in zip(range(4, 41), history, strict=True):
        finalised_upto = max(0, n // lag - 1) * lag  # chunks 0 .. n//lag - 2 are scored
        assert not scores[:finalised_upto].isnan().any(), n
        assert scores[finalised_upto:].isnan().all(), n
        want = ref_scores(sequence[:, :n], options)
        assert [w is None for w in want] == [t >= finalised_upto for t in range(n)]
        assert_matches_reference(scores[:n].tolist(), want)
    final = history[-1]
    for scores in history:  # once finalised, a score never changes
        done = ~scores.isnan()
        assert torch.equal(scores[done], final[done])


def test_lag_pending_rule_recent_keeps_the_unjudged_tail_and_neutral_scores_zero():
    lag = 4
    sequence = random_sequences([26], seed=8)[0]
    recent = get_policy("epikv-lag", **LAYER_OPTIONS, lag=lag)
    neutral = get_policy("epikv-lag", **LAYER_OPTIONS, lag=lag, pending="neutral")
    for policy in (recent, neutral):
        feed(policy, [sequence], [26], [])
    positions = torch.arange(26).unsqueeze(0)
    pending = list(range(20, 26))  # 26 tokens: chunks 0..4 finalised (needs chunk 5 = 20..23 complete)
    assert neutral.score(FakeView(neutral, positions, 10))[0, pending].tolist() == [0.0] * 6
    kept = recent.keep(FakeView(recent, positions, 4 + 6))[0].tolist()
    assert kept == [0, 1, 2, 3, *pending]
    kept = recent.keep(FakeView(recent, positions, 4 + 3))[0].tolist()  # too tight: newest pending first
    assert kept == [0, 1, 2, 3, 23, 24, 25]


# ---------------------------------------------------------------------------------------------- planted signal
def planted_signal(length: int = 64) -> tuple[torch.Tensor, list[int], list[int]]:
    generator = torch.Generator().manual_seed(4)
    g = 1.0 + 0.05 * torch.rand(LAYERS, length, generator=generator)  # smooth everywhere
    jumps_a, jumps_b = [20, 35, 50], [27, 44]
    for t in jumps_a:
        g[0:3, t] = 6.0  # band A layers only
    for t in jumps_b:
        g[3:6, t] = 6.0  # band B layers only
    return sequences_from_signal(g), jumps_a, jumps_b


@pytest.mark.parametrize(
    "options",
    [
        dict(variant="zscore"),
        dict(variant="zscore", stats_window=16),
        dict(variant="band"),
        dict(variant="raw", smooth=1),
        dict(variant="lag", lag=8, pending="neutral"),
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_planted_band_a_jumps_survive_and_band_b_jumps_go_first(options):
    sequence, jumps_a, jumps_b = planted_signal()
    layers = dict(a=1, b=4, band_a=(0, 1, 2), band_b=(3, 4, 5))
    policy = get_policy("epikv", **layers, **options)
    feed(policy, [sequence], [10], [1] * 54)
    positions = torch.arange(64).flip(0).unsqueeze(0)  # slot order need not follow positions
    kept = policy.keep(FakeView(policy, positions, budget=4 + len(jumps_a)))
    assert sorted(positions[0, kept[0]].tolist()) == [0, 1, 2, 3, *jumps_a]
    kept = policy.keep(FakeView(policy, positions, budget=64 - len(jumps_b)))
    assert sorted(set(range(64)) - set(positions[0, kept[0]].tolist())) == jumps_b


def test_planted_signal_with_lag_and_the_recent_pending_rule():
    sequence, jumps_a, _ = planted_signal()
    policy = get_policy("epikv-lag", a=1, b=4, lag=8)
    feed(policy, [sequence], [64], [])
    positions = torch.arange(64).unsqueeze(0)
    kept = policy.keep(FakeView(policy, positions, budget=4 + len(jumps_a) + 8))[0].tolist()
    assert kept == [0, 1, 2, 3, *jumps_a, *range(56, 64)]  # 56..63 pending (chunk 7 not yet followed)


# ---------------------------------------------------------------------------------------------- positional trend
def test_zscore_ignores_a_positional_trend_that_raw_follows():
    """The trend-correction claim, made exact.

    The rolling z-score is invariant to adding any constant to ``g`` over its window ``t - W .. t``,
    so a monotone trend that is constant over every window leaves every z unchanged. A smooth
    (e.g. linear) trend is removed only approximately: over a full window it shifts ``g(t) - mu`` by
    the constant ``c (W + 1) / 2`` but also inflates ``sigma`` by the trend's own spread, so z stays
    (nearly) an increasing affine function of the detrended ``g`` and rankings move a little. We
    therefore add a staircase trend (monotone increasing, constant on steps of 48 > W = 16
    positions, different slopes in layers a and b so raw ``g_a - g_b`` keeps it) and compare the
    tokens whose window lies within one step: their z-scores are unchanged and so is their ranking,
    while ``raw`` ranks every later step above every earlier one. Tokens whose window straddles a
    step see a transient and are excluded. (Looser check of the linear case below.)
    """
    length, step, w = 144, 48, 16
    generator = torch.Generator().manual_seed(6)
    g = 1.0 + torch.rand(LAYERS, length, generator=generator)
    stairs = torch.arange(length).div(step, rounding_mode="floor").double()
    trend = torch.zeros(LAYERS, length, dtype=torch.float64)
    trend[1] = 4.0 * stairs  # layer a
    trend[4] = 1.5 * stairs  # layer b
    plain, trended = sequences_from_signal(g, seed=1), sequences_from_signal(g + trend, seed=1)
    inside = [t for t in range(length) if t % step >= w and t >= w + 1]
    positions = torch.tensor([inside])

    def scores(variant, sequence):
        policy = get_policy("epikv", a=1, b=4, variant=variant, stats_window=w)
        feed(policy, [sequence], [20], [1] * (length - 20))
        return policy.token_scores(positions)[0]

    z_plain, z_trended = scores("zscore", plain), scores("zscore", trended)
    torch.testing.assert_close(z_trended, z_plain, rtol=1e-3, atol=1e-3)
    assert torch.equal(z_trended.argsort(), z_plain.argsort())
    raw_plain, raw_trended = scores("raw", plain), scores("raw", trended)
    assert not torch.equal(raw_trended.argsort(), raw_plain.argsort())
    by_step = [raw_trended[[i for i, t in enumerate(inside) if t // step == k]] for k in range(3)]
    assert by_step[0].max() < by_step[1].min() and by_step[1].max() < by_step[2].min()


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rx, ry = x.argsort().argsort().double(), y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def test_linear_trend_moves_raw_rankings_much_more_than_zscore_rankings():
    length, w = 200, 32
    generator = torch.Generator().manual_seed(7)
    g = 1.0 + torch.rand(LAYERS, length, generator=generator)
    trend = torch.zeros(LAYERS, length, dtype=torch.float64)
    trend[1] = 0.05 * torch.arange(length)
    plain, trended = sequences_from_signal(g, seed=2), sequences_from_signal(g + trend, seed=2)
    positions = torch.arange(w + 1, length).unsqueeze(0)

    def scores(variant, sequence):
        policy = get_policy("epikv", a=1, b=4, variant=variant, stats_window=w)
        feed(policy, [sequence], [length], [])
        return policy.token_scores(positions)[0]

    assert _spearman(scores("zscore", plain), scores("zscore", trended)) > 0.9
    assert _spearman(scores("raw", plain), scores("raw", trended)) < 0.5


# ---------------------------------------------------------------------------------------------- layers
def test_default_layers_scale_with_depth():
    assert default_anatomy(30).a == 9 and default_anatomy(30).b == 20
    assert default_anatomy(30).band_a == tuple(range(7, 13)) and default_anatomy(30).band_b == tuple(range(17, 24))
    assert default_anatomy(32).a == 10 and default_anatomy(32).b == 21
    assert default_anatomy(32).band_a == tuple(range(7, 14)) and default_anatomy(32).band_b == tuple(range(18, 26))
    assert [scale_layer(i, 16) for i in (10, 21, 7, 13)] == [5, 11, 4, 7]  # halves round up
    info30 = ModelInfo(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    assert EPIKV().needs(info30).hidden_layers == (9, 20)
    assert EPIKVLag().needs(info30).hidden_layers == (9, 20)
    assert EPIKV(variant="band").needs(info30).hidden_layers == (*range(7, 13), *range(17, 24))
    assert EPIKV(a=3, band_b="2..4").anatomy(30).a == 3
    assert EPIKV(band_b="2..4").anatomy(30).band_b == (2, 3, 4)
    assert EPIKV(band_a="1,5").anatomy(30).band_a == (1, 5)
    assert EPIKV(band_a=4, band_b=[5, 6]).band_a == (4,) and EPIKV(band_b=[5, 6]).band_b == (5, 6)
    assert not EPIKV().needs(info30).taps_attention


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(a=30), r"a=30 is out of range: the model has 30 decoder layers \(valid indices 0..29\)"),
        (dict(b=31), r"b=31 is out of range: the model has 30 decoder layers"),
        (dict(band_a=(5, 40), variant="band"), r"band_a=\(5, 40\) is out of range: the model has 30"),
    ],
)
def test_bad_layer_indices_name_the_model_depth(options, message):
    info30 = ModelInfo(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match=message):
        EPIKV(**options).needs(info30)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(variant="median"), "epikv: variant must be one of raw, zscore, band, lag, got 'median'"),
        (dict(stats_window=1), "stats_window must be an integer >= 2, got 1"),
        (dict(smooth=0), "smooth must be a positive integer, got 0"),
        (dict(lag=1), "lag must be an integer >= 2, got 1"),
        (dict(eps=0.0), "eps must be a positive number, got 0.0"),
        (dict(pending="oldest"), "pending must be one of recent, neutral, got 'oldest'"),
        (dict(a=-1), "a must be a layer index (an integer >= 0), got -1"),
        (dict(b=1.5), "epikv: option b=1.5: expected int or None"),
        (dict(band_a=()), "band_a must be a non-empty tuple of layer indices (integers >= 0), or text such as"),
        (dict(band_a="3..1"), "band_a must be a non-empty tuple of layer indices"),
        (dict(band_a=(1, -2)), "band_a must be a non-empty tuple of layer indices"),
        (dict(band_a=(1, 2.0)), "epikv: option band_a=(1, 2.0): expected tuple[int, ...] or None"),
        (dict(band_b="x,y"), "band_b must be a non-empty tuple of layer indices (integers >= 0), or text such as"),
        (dict(calibration=3), "epikv: option calibration=3: expected str or None"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        get_policy("epikv", **options)


# ---------------------------------------------------------------------------------------------- calibration
@pytest.mark.slow
def test_calibration_round_trip_and_use(tmp_path):
    path = tmp_path / "nested" / "tiny.json"
    written = write_calibration(
        path, model="tiny-llama", num_layers=3, a=0, b=2, band_a=[0], band_b=[1, 2], extra={"note": "hand-made"}
    )
    loaded = load_calibration(path)
    assert loaded == written and loaded.extra == {"note": "hand-made"}
    assert json.loads(path.read_text())["band_b"] == [1, 2]
    info3 = ModelInfo(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    assert EPIKV(calibration=str(path)).needs(info3).hidden_layers == (0, 2)
    assert EPIKV(calibration=path, variant="band").needs(info3).hidden_layers == (0, 1, 2)
    assert EPIKV(calibration=str(path), b=1).needs(info3).hidden_layers == (0, 1)  # options win
    model = tiny_llama()
    with reasonkv.EvictingCache(16, 4, model=model, policy="epikv", calibration=str(path)) as cache:
        assert cache.evictor.needs.hidden_layers == (0, 2)
        model(input_ids=torch.tensor([PROMPT]), use_cache=True, **{_cache_key(model): cache})
        assert cache.evictions == 1
    [result] = reasonkv.generate(
        model,
        NoEosTokenizer(),
        "Calibrated layers.",
        policy="epikv",
        calibration=str(path),
        budget=12,
        buffer=4,
        max_new_tokens=20,
    )
    assert result.stats["evictions"] > 0


def _cache_key(model) -> str:
    from reasonkv.hf import cache_keyword

    return cache_keyword(model)


def _write(tmp_path, data, name="bad.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


GOOD = {"model": "m", "num_layers": 3, "a": 0, "b": 2, "band_a": [0], "band_b": [2]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", "is not readable JSON"),
        ([1, 2], "must hold a JSON object, got list"),
        ({k: v for k, v in GOOD.items() if k != "band_b"}, "lacks band_b; required keys: model, num_layers"),
        ({**GOOD, "a": "0"}, "a must be a JSON integer, got '0'"),
        ({**GOOD, "num_layers": True}, "num_layers must be a JSON integer"),
        ({**GOOD, "band_a": 3}, "band_a must be a JSON list of integers, got 3"),
        ({**GOOD, "band_a": []}, "band_a must name at least one layer"),
        ({**GOOD, "band_b": [1, "2"]}, "band_b must hold integer layer indices"),
        ({**GOOD, "b": 3}, "b=3 is out of range: the model has 3 decoder layers"),
    ],
)
def test_bad_calibration_files_are_clear_errors(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=rf"calibration file '.*bad.json'.*{re.escape(message)}"):
        load_calibration(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        get_policy("epikv", calibration=path)


def test_calibration_for_another_depth_is_refused(tmp_path):
    path = _write(tmp_path, {**GOOD, "model": "big-model", "num_layers": 30, "b": 20}, "big.json")
    with pytest.raises(ValueError, match=r"is for a model with 30 layers \(big-model\), but this model has 3 layers"):
        reasonkv.EvictingCache(16, 4, model=tiny_llama(), policy="epikv", calibration=path)
    with pytest.raises(ValueError, match="does not exist"):
        get_policy("epikv", calibration=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------- on a model
def _refusing_sdpa(module, query, key, value, attention_mask, **kwargs):
    if kwargs.get("output_attentions"):
        raise AssertionError("attention weights were requested")
    output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return output, None


AttentionInterface.register("epikv_refusing_sdpa", _refusing_sdpa)
AttentionMaskInterface.register("epikv_refusing_sdpa", sdpa_mask)


@pytest.mark.parametrize(
    "options",
    [
        dict(policy="epikv"),
        pytest.param(dict(policy="epikv-lag", lag=4), marks=pytest.mark.slow),
        pytest.param(dict(variant="band"), marks=pytest.mark.slow),
    ],
)
def test_runs_where_attention_weights_and_eager_are_refused(monkeypatch, options):
    import transformers.models.llama.modeling_llama as llama_module

    def no_eager(*args, **kwargs):
        raise AssertionError("the eager attention kernel was used")

    monkeypatch.setattr(llama_module, "eager_attention_forward", no_eager)
    model = tiny_llama()
    model.config._attn_implementation = "epikv_refusing_sdpa"
    options = {"policy": "epikv", **options}
    [result] = reasonkv.generate(
        model, NoEosTokenizer(), "Nothing but hidden states here.", budget=16, buffer=4, max_new_tokens=24, **options
    )
    assert result.num_tokens == 24 and result.stats["evictions"] > 0
    assert model.config._attn_implementation == "epikv_refusing_sdpa"


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(variant="raw", smooth=2), marks=pytest.mark.slow),
        dict(variant="zscore", stats_window=16),
        pytest.param(dict(variant="band"), marks=pytest.mark.slow),
        pytest.param(dict(variant="lag", lag=8), marks=pytest.mark.slow),
        pytest.param(dict(variant="lag", lag=8, pending="neutral"), marks=pytest.mark.slow),
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_oracle_for_every_variant(options):
    cache = run_and_check(tiny_llama(), "epikv", PROMPT, budget=24, buffer=6, steps=40, **options)
    assert cache.evictions >= 3
    for layer in range(1, 3):  # one token set shared by every layer and head
        assert torch.equal(cache.positions(layer), cache.positions(0))
    assert (cache.positions(0)[0, 0] == cache.positions(0)[0]).all()


def test_scores_on_a_real_model_match_the_reference_from_its_hidden_states():
    model = tiny_llama()
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}

    def recorder(layer):
        def hook(module, args, output):
            captured[layer].append((output[0] if isinstance(output, tuple) else output)[0].detach().clone())

        return hook

    handles = [model.model.layers[i].register_forward_hook(recorder(i)) for i in range(3)]
    options = dict(variant="band", a=0, b=2, band_a=(0, 1), band_b=(2,), stats_window=6)
    try:
        with reasonkv.EvictingCache(1000, 8, model=model, policy="epikv", **options) as cache:
            assert cache.evictor.needs.hidden_layers == (0, 1, 2)
            key = _cache_key(model)
            out = model(input_ids=torch.tensor([PROMPT[:20]]), use_cache=True, **{key: cache})
            for _ in range(10):
                out = model(input_ids=out.logits[0, -1].argmax().view(1, 1), use_cache=True, **{key: cache})
            scores = cache.evictor.policy.token_scores(torch.arange(30).unsqueeze(0))[0]
    finally:
        for handle in handles:
            handle.remove()
    sequence = torch.stack([torch.cat(captured[layer], dim=0) for layer in range(3)])  # [3, 30, 64]
    assert_matches_reference(scores.tolist(), ref_scores(sequence, options))


@pytest.mark.integration
@pytest.mark.slow
def test_smollm2_runs_and_stays_within_the_budget():
    model, tokenizer = reasonkv.load_model("smollm2-135m")
    slots, layers = [], set()

    def on_step(step, cache):
        slots.append(cache.slots)
        layers.add(cache.evictor.needs.hidden_layers)

    [result] = reasonkv.generate(
        model,
        tokenizer,
        "Solve step by step: a train travels 60 km in 45 minutes. What is its speed in km/h?",
        policy="epikv",
        budget=64,
        buffer=16,
        max_new_tokens=120,
        ignore_eos=True,
        on_step=on_step,
    )
    assert result.num_tokens == 120
    assert result.stats["evictions"] > 0
    assert result.stats["peak_slots"] <= 80 and max(slots) <= 80
    assert layers == {(9, 20)}  # 30 layers: a = round(10 * 30 / 32), b = round(21 * 30 / 32)
