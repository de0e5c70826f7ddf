"""Step timing: windows, the split of a step, prefill chunks, the prefilled mode, one eviction's cost."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from reasonkv.bench.eviction import measure_eviction_cost
from reasonkv.bench.measure import make_prompts, measure_sweep, window_stats
from reasonkv.bench.memory import kv_bytes_per_token
from reasonkv.bench.prefilled import measure_prefilled, prefill_chunks
from reasonkv.cache import CacheSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_window_stats_split_sums_to_the_mean_step():
    steps = [0.010, 0.012, 0.011, 0.030]  # the last step evicted
    before = {"record": 1.0, "observe": 2.0, "score": 0.5}
    after = {"record": 1.004, "observe": 2.002, "score": 0.514, "gather": 0.006}
    stats = window_stats(steps, before, after, evictions=1, batch=4)
    mean = 0.063 / 4
    assert stats["step_mean_s"] == pytest.approx(mean)
    assert stats["step_median_s"] == pytest.approx(0.0115)
    split = stats["split_s"]
    assert split["record"] == pytest.approx(0.004 / 4)
    assert split["observe"] == pytest.approx(0.002 / 4)
    assert split["score"] == pytest.approx(0.014 / 4)
    assert split["gather"] == pytest.approx(0.006 / 4)
    assert split["forward"] == pytest.approx(mean - 0.026 / 4)
    assert sum(split.values()) == pytest.approx(mean)
    assert stats["eviction_overhead_s"] == pytest.approx(0.026 / 4)
    assert stats["tokens_per_s"] == pytest.approx(4 / mean)
    with pytest.raises(ValueError, match="at least one"):
        window_stats([], {}, {}, evictions=0, batch=1)


def test_prompts_are_seeded_and_avoid_special_ids():
    a = make_prompts(512, 3, 32, seed=1)
    assert a == make_prompts(512, 3, 32, seed=1) != make_prompts(512, 3, 32, seed=2)
    assert len(a) == 3 and all(len(row) == 32 and min(row) >= 100 and max(row) < 512 for row in a)
    assert a[0] != a[1]


def _capacities(chunks: list[int], steps: int) -> int:
    """Independent model of the full cache's growth: a buffer doubles (or grows to fit) when full."""
    capacity = used = 0
    for size in [*chunks, *([1] * steps)]:
        if used + size > capacity:
            capacity = max(used + size, 2 * capacity)
        used += size
    return capacity


@pytest.mark.parametrize(
    "length, steps, cap, prompt",
    [(65536, 258, 8192, 32), (4096, 258, 0, 32), (1024, 66, 100, 32), (96, 10, 1000, 16)],
)
def test_full_cache_prefill_chunks_end_at_exactly_the_length(length, steps, cap, prompt):
    chunks = prefill_chunks(length - steps, length, 1, cap, prompt_length=prompt, grows=True)
    assert sum(chunks) == length - steps
    assert chunks[0] == prompt  # the prompt is its own forward; the rest follows as if generated
    if cap:
        assert max(chunks) <= cap
    assert _capacities(chunks, steps) == length


def test_prefill_chunks_cap_tokens_summed_over_the_batch():
    assert prefill_chunks(1000, 1256, 4, 1024, prompt_length=32, grows=False) == [32, 256, 256, 256, 200]
    assert prefill_chunks(1000, 1256, 1, 0, prompt_length=32, grows=False) == [32, 968]
    assert prefill_chunks(5, 9, 8, 2, prompt_length=1, grows=False) == [1] * 5  # at least one token per row
    assert prefill_chunks(20, 40, 1, 0, prompt_length=32, grows=False) == [20]  # all of it is the prompt
    # no power-of-two divisor of the length within the cap: the cap is used as is
    assert prefill_chunks(999, 1005, 1, 300, prompt_length=32, grows=True) == [32, 300, 300, 300, 67]
    with pytest.raises(ValueError, match="at least one"):
        prefill_chunks(0, 8, 1, 0, prompt_length=4, grows=False)


def test_sweep_windows_split_and_cache_numbers():
    model = tiny_llama()
    per_token = kv_bytes_per_token(model.config, torch.float32)
    budget, buffer, window = 16, 8, 16
    data = measure_sweep(
        model,
        CacheSpec.build("streaming", budget, buffer),
        batch=2,
        prompt_length=8,
        lengths=[40, 64],
        window=window,
    )
    assert data["kv_bytes_per_token"] == per_token
    assert len(data["trace"]["step_s"]) == 64 - 8 == data["totals"]["decode_steps"]
    for w in data["windows"]:
        assert w["window_steps"] == window
        assert sum(w["split_s"].values()) == pytest.approx(w["step_mean_s"], abs=1e-12)
        assert w["evictions"] == window // buffer  # steady state: one eviction per B steps
        assert w["kv_bytes"] == (budget + buffer) * per_token * 2
        assert w["slots"] <= budget + buffer
        assert w["tokens_per_s"] == pytest.approx(2 / w["step_mean_s"])
    # the trace and the windows agree
    last = data["windows"][-1]
    # (the trace is rounded to 0.1 us per step: its mean is within 0.05 us of the exact one)
    assert last["step_mean_s"] == pytest.approx(sum(data["trace"]["step_s"][-window:]) / window, abs=5e-8)


def test_prefilled_full_cache_holds_exactly_the_length():
    model = tiny_llama()
    per_token = kv_bytes_per_token(model.config, torch.float32)
    w = measure_prefilled(model, CacheSpec.build("full", 16, 8), batch=1, length=64, decode_steps=8, prompt_length=8)
    assert w["prefilled_tokens"] == 54 and w["window_steps"] == 8 and w["length"] == 64  # 2 untimed steps
    assert w["prompt_length"] == 8 and w["prefill_chunks"] == 3  # 8, 24 (the cache holds 32), 22 (64)
    assert w["slots"] == 64 and w["kv_bytes"] == 64 * per_token
    assert w["evictions"] == 0
    assert sum(w["split_s"].values()) == pytest.approx(w["step_mean_s"], abs=1e-12)


def test_prefilled_evicting_policy_starts_in_its_steady_state():
    model = tiny_llama()
    per_token = kv_bytes_per_token(model.config, torch.float32)
    # prefill 8 + 20 + 20 + 6 tokens (20 per row per forward), evicted to K = 16 after each forward that
    # reaches K + B = 24: 16 + 6 = 22 held; 2 untimed steps reach 24 and evict; 8 timed steps evict once more.
    w = measure_prefilled(
        model,
        CacheSpec.build("streaming", 16, 8),
        batch=2,
        length=64,
        decode_steps=8,
        prefill_chunk=40,
        prompt_length=8,
    )
    assert w["prefill_chunks"] == 4
    assert w["evictions"] == 1
    assert w["slots"] == 16
    assert w["kv_bytes"] == 24 * per_token * 2


def test_eviction_cost_times_one_eviction_per_repeat():
    model = tiny_llama()
    result = measure_eviction_cost(model, CacheSpec.build("streaming", 40, 8), repeats=3)
    assert result["budget"] == 40 and result["cached"] == 48
    assert len(result["eviction_s"]) == len(result["score_s"]) == len(result["gather_s"]) == 3
    assert all(s > 0 for s in result["eviction_s"])
    assert result["mean_s"] == pytest.approx(sum(result["eviction_s"]) / 3)
    assert result["min_s"] <= result["median_s"] <= max(result["eviction_s"])
    with pytest.raises(ValueError, match="needs a policy that evicts .* got full"):
        measure_eviction_cost(model, CacheSpec.build("full", 40, 8), repeats=1)
    with pytest.raises(ValueError, match="a buffer of at least 1 token, got streaming with buffer 0"):
        measure_eviction_cost(model, CacheSpec.build("streaming", 40, 0))
