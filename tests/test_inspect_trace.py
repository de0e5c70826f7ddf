"""The eviction trace agrees with the cache at every eviction, for every policy, with a quantized tier and on
a hybrid model; recording it changes nothing; it round-trips through its file and stays small."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reasonkv
from conftest import NoEosTokenizer, fast_few, tiny_gemma3, tiny_llama
from reasonkv.cache import CacheSpec
from reasonkv.cache.decisions import DecisionLog, Eviction, Trace
from reasonkv.inspect.trace import load_trace, save_trace
from reasonkv.policies import policy_class
from reasonkv.policies.h2o import H2O

EVICTING = [name for name in reasonkv.list_policies() if policy_class(name).evicts]
PROMPT = "A prompt of some length."
# Small enough to evict several times in a short run, large enough for every policy's protection.
SMALL = {"snapkv": dict(window=4, query_window=4), "vase-attnv": dict(window=4, query_window=4)}


def _options(policy: str) -> dict:
    options = dict(SMALL.get(policy, {}))
    if policy_class(policy).options().get("protect_prompt"):
        options["protect_prompt"] = False  # the prompt exceeds K
    if policy_class(policy).options().get("window", 0) > 4:
        options["window"] = 4
    return options


def _held(positions: torch.Tensor, seen: int) -> np.ndarray:
    """``[heads, S]`` positions of row 0 -> ``[heads, seen]`` bool."""
    mask = np.zeros((positions.shape[0], seen), dtype=bool)
    for h, row in enumerate(positions.tolist()):
        mask[h, [p for p in row if p >= 0]] = True
    return mask


def _decode_checking(model, policy: str, **kw) -> tuple[reasonkv.GenerationResult, int]:
    """Decode with a trace, checking after each forward that a new eviction's record equals the cache."""
    checked = 0

    def check(step, cache):
        nonlocal checked
        evictions = cache.evictor.log.by_row[0]
        if len(evictions) == checked:
            return
        assert len(evictions) == checked + 1, "one eviction per forward at most"
        last: Eviction = evictions[-1]
        recorder = cache.evictor.log
        assert last.seen == int(cache.next_position[0])
        kept, before = last.kept_mask(), last.before_mask()
        for t, layer in enumerate(recorder.layers):
            assert np.array_equal(kept[t], _held(cache.positions(layer)[0], last.seen)), (policy, step, layer)
        full = [t for t, kind in enumerate(recorder.kinds) if kind == "full"]
        assert (kept[full] <= before).all()
        assert before.sum() > kept[full].sum() or cache.quantized  # a tier that is not full yet only takes tokens in
        assert (last.protected_mask() <= kept[full]).all()  # protected tokens are never evicted
        if cache.quantized:
            quantized = last.quantized_mask()
            held_quantized = cache.quantized_mask()[0]
            for e, layer in enumerate(cache.full_layers):
                expected = cache.positions(layer)[0][:, held_quantized]
                assert np.array_equal(quantized[e], _held(expected, last.seen))
        n = before[0, 0].sum()
        if last.scores is not None:
            assert last.scores.shape == (len(full), kept.shape[1], n)
        if last.ranks is not None:  # ranks 1..n over the held slots; the kept are the top K (a tier ranks on)
            assert (np.sort(last.ranks, -1) == np.arange(1, n + 1)).all()
            if not cache.quantized:
                for e, t in enumerate(full):
                    for h in range(kept.shape[1]):
                        held = np.flatnonzero(before[e, h])
                        assert np.array_equal(last.ranks[e, h] <= cache.budget, kept[t, h, held]), (policy, e, h)
        checked += 1

    [result] = reasonkv.generate(model, NoEosTokenizer(), PROMPT, policy=policy, trace=True, on_step=check, **kw)
    assert result.trace is not None and len(result.trace.evictions) == checked == result.stats["evictions"]
    return result, checked


@pytest.mark.parametrize("policy", fast_few(EVICTING))
def test_trace_equals_the_cache_at_every_eviction(policy, one_torch_thread):
    model = tiny_llama()
    kw = dict(budget=12, buffer=4, max_new_tokens=28, seed=3, **_options(policy))
    traced, evictions = _decode_checking(model, policy, **kw)
    assert evictions >= 3
    [plain] = reasonkv.generate(model, NoEosTokenizer(), PROMPT, policy=policy, **kw)
    assert plain.token_ids == traced.token_ids and plain.trace is None  # recording changes nothing


@pytest.mark.parametrize("policy", ["h2o", "random", "snapkv"])
def test_trace_with_a_quantized_tier(policy, one_torch_thread):
    kw = dict(budget=10, buffer=4, quantized=16, bits=4, max_new_tokens=48, seed=1, **_options(policy))  # one key group
    result, evictions = _decode_checking(tiny_llama(), policy, **kw)
    last = result.trace.evictions[-1]
    assert evictions >= 3 and last.quantized_mask().any()
    assert last.before_mask().sum() > last.kept_mask().sum()  # once the tier is full, evictions drop tokens


@pytest.mark.parametrize("policy", ["h2o", "streaming", "epikv", "vase-attnv"])
def test_trace_on_a_hybrid_model_shows_the_sliding_layers_as_such(policy, one_torch_thread):
    result, evictions = _decode_checking(
        tiny_gemma3(), policy, budget=12, buffer=5, max_new_tokens=24, **_options(policy)
    )
    assert evictions >= 2
    trace = result.trace
    assert trace.kinds == ("sliding", "full", "sliding", "full") and trace.layers == (0, 1, 2, 3)


@pytest.mark.parametrize("variant", ["zscore", "band", "raw"])
def test_epikv_records_its_two_bands_whose_difference_is_its_score(variant, one_torch_thread):
    """At every eviction: band A minus band B is the score the policy ranked with (float16 apart)."""
    kw = dict(budget=12, buffer=4, max_new_tokens=28, seed=3, variant=variant)
    [result] = reasonkv.generate(tiny_llama(), NoEosTokenizer(), PROMPT, policy="epikv", trace=True, **kw)
    assert len(result.trace.evictions) >= 3
    for eviction in result.trace.evictions:
        a, b = (eviction.signal(name).astype(np.float32) for name in ("band_a", "band_b"))
        score = eviction.scores[0, 0].astype(np.float32)  # one kept set: every layer and head scores alike
        assert a.shape == b.shape == score.shape == (eviction.before_mask()[0, 0].sum(),)
        assert (eviction.scores == eviction.scores[0, 0]).all()
        difference = np.nan_to_num(a - b) if variant == "raw" else a - b  # raw: an undefined mean scores 0
        tolerance = 1e-3 * (np.abs(np.nan_to_num(a)) + np.abs(np.nan_to_num(b)) + np.abs(score)) + 1e-6
        assert (np.abs(difference - score) <= tolerance).all(), (variant, eviction.seen, difference, score)
        assert np.ptp(np.nan_to_num(a)) > 0.01 and not np.allclose(np.nan_to_num(a), np.nan_to_num(b))


def test_epikv_lag_records_no_band_of_a_token_it_has_not_scored(one_torch_thread):
    """``lag``: the pending tokens (ranked first, above every position) have no bands; the others are ordered
    by band A minus band B, as the policy ranked them."""
    kw = dict(budget=12, buffer=4, max_new_tokens=28, seed=3, variant="lag", lag=4)
    [result] = reasonkv.generate(tiny_llama(), NoEosTokenizer(), PROMPT, policy="epikv", trace=True, **kw)
    for eviction in result.trace.evictions:
        a, b = (eviction.signal(name).astype(np.float32) for name in ("band_a", "band_b"))
        score = eviction.scores[0, 0].astype(np.float32)
        pending = score >= len(score)  # "recent": the slot count plus the position
        assert pending.any() and (~pending).sum() >= 4
        assert np.array_equal(np.isnan(a), pending) and np.array_equal(np.isnan(b), pending)
        difference = (a - b)[~pending]
        ranked = score[~pending]
        clearly_below = difference[:, None] + 0.01 < difference[None, :]
        assert clearly_below.any() and (ranked[:, None] < ranked[None, :])[clearly_below].all()


@pytest.mark.parametrize("policy", ["vase-attnv", "vase-dkv"])
def test_vase_records_the_value_ranges_and_the_reserve_it_kept(policy, one_torch_thread):
    """The recorded value range of every kept token is its value's in the cache; the reserve is the ``N_v``
    unprotected tokens of each head with the largest range, and the policy kept all of them."""
    reserve, budget = 4, 12
    checked = []

    def check(step, cache):
        evictions = cache.evictor.log.by_row[0]
        if len(evictions) == len(checked):
            return
        last: Eviction = evictions[-1]
        before, kept, protected = last.before_mask(), last.kept_mask(), last.protected_mask()
        ranges, reserved = last.signal("value_range").astype(np.float32), last.signal("reserve")
        for e, layer in enumerate(cache.full_layers):
            values = cache.layers[layer].values[0].float()  # [heads, slots, head_dim], after the gather
            for h, slots in enumerate(cache.positions(layer)[0].tolist()):
                held = np.flatnonzero(before[e, h]).tolist()
                for slot, position in enumerate(slots):
                    if position >= 0:
                        in_cache = float(values[h, slot].max() - values[h, slot].min())
                        assert ranges[e, h, held.index(position)] == pytest.approx(in_cache, rel=2e-3, abs=1e-4)
                candidates = before[e, h] & ~protected[e, h]
                assert reserved[e, h].sum() == min(reserve, budget - protected[e, h].sum(), candidates.sum())
                assert (reserved[e, h] <= candidates).all() and (reserved[e, h] <= kept[e, h]).all()
                by_position = np.full(last.seen, np.nan, dtype=np.float32)
                by_position[held] = ranges[e, h]
                others = candidates & ~reserved[e, h]
                assert by_position[reserved[e, h]].min() >= by_position[others].max(), (policy, e, h)
        checked.append(last.seen)

    kw = dict(budget=budget, buffer=4, max_new_tokens=28, seed=3, reserve=reserve, **_options(policy))
    [result] = reasonkv.generate(tiny_llama(), NoEosTokenizer(), PROMPT, policy=policy, trace=True, on_step=check, **kw)
    assert len(checked) == len(result.trace.evictions) >= 3


def test_a_trace_round_trips_through_its_file(tmp_path, one_torch_thread):
    [result] = reasonkv.generate(
        tiny_llama(), NoEosTokenizer(), PROMPT, policy="h2o", budget=10, buffer=4, max_new_tokens=20, trace=True
    )
    path = tmp_path / "trace.npz"
    save_trace(path, {"h2o": {"trace": result.trace, "token_ids": result.token_ids}})
    loaded = load_trace(path)["h2o"]
    trace: Trace = loaded["trace"]
    assert loaded["token_ids"] == result.token_ids and trace.settings == result.trace.settings
    assert trace.kinds == result.trace.kinds and len(trace.evictions) == len(result.trace.evictions) > 0
    for a, b in zip(trace.evictions, result.trace.evictions, strict=True):
        assert a.seen == b.seen and np.array_equal(a.kept, b.kept) and np.array_equal(a.scores, b.scores)
        assert np.array_equal(a.ranks, b.ranks) and a.ranks is not None
    [vase] = reasonkv.generate(
        tiny_llama(),
        NoEosTokenizer(),
        PROMPT,
        policy="vase-attnv",
        budget=10,
        buffer=4,
        max_new_tokens=20,
        trace=True,
        **_options("vase-attnv"),
    )
    save_trace(path, {"vase-attnv": {"trace": vase.trace}})
    for a, b in zip(load_trace(path)["vase-attnv"]["trace"].evictions, vase.trace.evictions, strict=True):
        assert set(a.signals) == set(b.signals) == {"value_range", "reserve"}
        assert all(np.array_equal(a.signal(name), b.signal(name)) for name in a.signals)
        assert a.signal("reserve").dtype == bool and a.signal("reserve").any()
    (tmp_path / "other.npz").write_bytes(b"not a trace")
    with pytest.raises(ValueError, match="not a reasonkv trace"):
        load_trace(tmp_path / "other.npz")


@pytest.mark.parametrize("settings", [dict(allocation="pyramid"), dict(quantized=16, bits=4)])
def test_the_trace_reads_the_ranking_the_evictor_kept_by(settings, monkeypatch, one_torch_thread):
    """Under an allocation or a tier the evictor ranks to keep; the trace reads that ranking and asks the policy
    for none again: a traced run ranks as often as a plain one, and keeps the same tokens."""
    calls = []
    ranking = H2O.ranking
    monkeypatch.setattr(H2O, "ranking", lambda self, view: calls.append(view.layer) or ranking(self, view))
    spec = CacheSpec.build("h2o", 10, 4, seed=3, **settings)
    kw = dict(spec=spec, max_new_tokens=28)
    [plain] = reasonkv.generate(tiny_llama(), NoEosTokenizer(), PROMPT, **kw)
    untraced, calls[:] = len(calls), []
    [traced] = reasonkv.generate(tiny_llama(), NoEosTokenizer(), PROMPT, trace=True, **kw)
    assert traced.token_ids == plain.token_ids and len(traced.trace.evictions) >= 3
    assert traced.trace.evictions[-1].ranks is not None and len(calls) == untraced > 0


def test_a_recorder_needs_an_attached_cache():
    with pytest.raises(ValueError, match="attached to a model"):
        DecisionLog(reasonkv.EvictingCache(8, 4))


def test_tracing_is_off_by_default_and_then_records_nothing(monkeypatch, one_torch_thread):
    """No log unless asked: the evictor's only cost is one attribute check per eviction."""
    monkeypatch.setattr("reasonkv.generation.loop.DecisionLog", lambda cache: pytest.fail("a log was made"))
    recorders = []
    kw = dict(policy="h2o", budget=10, buffer=4, max_new_tokens=20)
    on_step = lambda step, cache: recorders.append(cache.evictor.log)  # noqa: E731
    [result] = reasonkv.generate(tiny_llama(), NoEosTokenizer(), PROMPT, on_step=on_step, **kw)
    assert result.trace is None and result.stats["evictions"] >= 2 and set(recorders) == {None}
