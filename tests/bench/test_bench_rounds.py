"""Interleaved rounds, the warm-up until stable, and one cache extended from length to length."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch

from conftest import tiny_llama
from reasonkv.bench.clock import gpu_clock_mhz
from reasonkv.bench.compiled import compiled_summary
from reasonkv.bench.prefilled import PrefilledSession, extension_chunks
from reasonkv.bench.report import summarise
from reasonkv.bench.rounds import combine_rounds, interleaved, run_rounds, same_rounds, spread
from reasonkv.bench.warmup import settle
from reasonkv.cache import CacheSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _window(length: int, step: float, **extra) -> dict:
    window = {"length": length, "step_mean_s": step, "step_median_s": step, "tokens_per_s": 1 / step}
    return {**window, "split_s": {"forward": step}, **extra}


def test_rounds_interleave_the_entries():
    assert interleaved(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rounds must be a positive integer"):
            interleaved(["a"], bad)


def test_run_rounds_measures_a_b_c_a_b_c_and_drops_a_failing_entry():
    calls, finished, failures = [], {}, []

    def measure(entry, index):
        calls.append((entry, index))
        if entry == "b" and index == 1:
            raise RuntimeError("synthetic")
        return {"entry": entry, "round": index}

    collected = run_rounds(
        ["a", "b", "c"],
        3,
        measure,
        lambda entry, datas: finished.setdefault(entry, [d["round"] for d in datas]),
        failed=lambda entry, error: failures.append((entry, str(error))),
    )
    # b failed in round 2: not measured again, never finished; a and c finish after their third round
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1), ("a", 2), ("c", 2)]
    assert finished == {"a": [0, 1, 2], "c": [0, 1, 2]} and failures == [("b", "synthetic")]
    assert [d["round"] for d in collected["b"]] == [0]


def test_an_interruption_leaves_the_rounds_measured_so_far():
    seen = {}

    def measure(entry, index):
        if (entry, index) == ("a", 1):
            raise KeyboardInterrupt
        return {"round": index}

    with pytest.raises(KeyboardInterrupt):
        run_rounds(["a", "b"], 2, measure, lambda *_: pytest.fail("nothing finished"), failed=None, collected=seen)
    assert seen == {"a": [{"round": 0}], "b": [{"round": 0}]}


def test_the_figure_is_the_median_round_with_the_spread_beside_it():
    steps = {64: [0.030, 0.010, 0.020], 128: [0.012, 0.050, 0.011]}
    datas = [
        {"windows": [_window(n, steps[n][r], gpu_clock_mhz=1000 + r) for n in (64, 128)], "round": r} for r in range(3)
    ]
    combined = combine_rounds(datas)
    w64, w128 = combined["windows"]
    assert w64["step_mean_s"] == 0.020 and w64["rounds"]["median_round"] == 2 and w64["gpu_clock_mhz"] == 1002
    assert w128["step_mean_s"] == 0.012 and w128["rounds"]["median_round"] == 0
    assert w64["rounds"]["step_mean_s"] == [0.030, 0.010, 0.020]
    assert w64["rounds"]["gpu_clock_mhz"] == [1000, 1001, 1002]
    assert w64["step_mean_spread_s"] == {"min": 0.010, "q1": 0.015, "median": 0.020, "q3": 0.025, "max": 0.030}
    assert combined["round"] == 0  # the rest of the record: the median round at the longest length
    # an even count: the lower middle round, so that the figure is one round's own (split and all)
    two = combine_rounds(datas[:2])
    assert two["windows"][0]["step_mean_s"] == 0.010 and two["windows"][1]["step_mean_s"] == 0.012
    assert spread([5.0]) == {"min": 5.0, "q1": 5.0, "median": 5.0, "q3": 5.0, "max": 5.0}
    with pytest.raises(ValueError, match="no rounds"):
        combine_rounds([])


def _sweep_record(policy: str, group: str | None, step: float) -> dict:
    record = {
        "mode": "sweep",
        "policy": policy,
        "batch": 1,
        "evicts": policy != "full",
        "config": {"budget": 16, "buffer": 8, "lengths": [64]},
        "windows": [_window(64, step, window_start=48, eviction_overhead_s=0.0, kv_bytes=1, prefill_evictions=0)],
    }
    if group is not None:
        record["rounds_group"] = group
    return record


def test_a_ratio_needs_both_entries_from_the_same_rounds():
    assert same_rounds({"rounds_group": "g"}, {"rounds_group": "g"}) and same_rounds({}, {})
    assert not same_rounds({"rounds_group": "g"}, {"rounds_group": "h"})
    assert not same_rounds({"rounds_group": "g"}, {})

    records = [_sweep_record("full", "g", 0.010), _sweep_record("streaming", "g", 0.005)]
    records.append(_sweep_record("random", "h", 0.005))  # measured in other rounds (a resumed run, say)
    policies = summarise(records)["sweep"]["1"]["policies"]
    assert policies["streaming"]["tokens_per_s_vs_full"] == {64: pytest.approx(2.0)}
    assert policies["random"]["tokens_per_s_vs_full"] == {} and policies["random"]["step_vs_streaming"] == {}
    assert policies["random"]["overhead_pct"] == {64: None}

    compiled = [_sweep_record("streaming", "g", 0.010), _sweep_record("streaming~compiled", "g", 0.005)]
    compiled.append(_sweep_record("transformers~compiled", "h", 0.004))
    summary = compiled_summary(compiled)["1"]["streaming~compiled"]
    assert summary["compiled_vs_eager"] == {64: pytest.approx(2.0)} and summary["vs_transformers_compiled"] == {}
    compiled[0]["rounds_group"] = "h"
    assert compiled_summary(compiled) == {}
    # The eager entry is the folder's last record of the policy and batch: an older one of the same rounds is
    # not taken in its place.
    older = [_sweep_record("streaming", "g", 0.010), *compiled]
    assert compiled_summary(older) == {}


def test_warm_up_stops_once_stable_or_at_its_cap():
    settling = itertools.chain([0.09, 0.08, 0.07, 0.06, 0.05], itertools.repeat(0.02))
    result = settle(lambda: next(settling), window=4, last=3, tolerance=0.05, cap=200)
    assert result["stable"] and result["steps"] == 16  # windows 2 to 4 agree (the first held the slow steps)
    assert result["window_medians_s"][1:] == [0.02, 0.02, 0.02]

    noisy = itertools.cycle([0.01] * 4 + [0.03] * 4)  # alternate windows never agree
    result = settle(lambda: next(noisy), window=4, last=3, tolerance=0.05, cap=30)
    assert not result["stable"] and result["steps"] == 28  # the last whole window within the cap
    with pytest.raises(ValueError, match="last must be an integer >= 2"):
        settle(lambda: 0.0, last=1)


def test_no_gpu_clock_on_a_cpu():
    assert gpu_clock_mhz(torch.device("cpu")) is None


def test_one_cache_extended_from_length_to_length_and_dropped_before_a_fresh_one():
    model = tiny_llama()
    session = PrefilledSession(model, CacheSpec.build("streaming", 16, 8), batch=1, top=160, prompt_length=8)
    first = session.measure(64, 8)
    cache = weakref.ref(session.cache)
    second = session.measure(128, 8)  # room for the tokens in between: the same cache, extended
    assert session.cache is cache()
    assert first["extended_from"] == 0 and first["prefilled_tokens"] == 64 - 8 - 2
    assert second["extended_from"] == 64 and second["prefilled_tokens"] == 128 - 64 - 8 - 2
    assert second["window_steps"] == 8 and second["evictions"] >= 0 and second["slots"] <= 16 + 8
    third = session.measure(132, 8)  # too close to 128 for its 10 decode steps: a fresh cache
    assert third["extended_from"] == 0 and cache() is None  # the old one freed before the new one was built
    fresh = weakref.ref(session.cache)
    session.close()
    gc.collect()
    assert fresh() is None and session.cache is None
    with pytest.raises(ValueError, match="beyond the session's longest length 160"):
        session.measure(200, 8)
    assert extension_chunks(10, 2, 8) == [4, 4, 2] and extension_chunks(10, 1, 0) == [10]


def test_a_compiled_window_leaves_the_model_untapped_for_the_plain_reference_after_it():
    from reasonkv.hf.tap import check_untapped

    model = tiny_llama()
    session = PrefilledSession(
        model, CacheSpec.build("streaming", 16, 8), batch=1, top=64, prompt_length=8, compile="aot_eager"
    )
    try:
        window = session.measure(64, 8)
        assert window["compile"]["compiled"] and window["compile"]["eager_reason"] is None
        check_untapped(model)  # the compiled run closed with its window, while the session still holds its cache
    finally:
        session.close()
