"""The overhead summary on synthetic records with known step times."""

from __future__ import annotations

import pytest

from reasonkv.bench.report import markdown, summarise, summary_text

K, B = 512, 128
PER_TOKEN = 1000


def _window(length, step, overhead=0.0, kv=None, start=None):
    return {
        "length": length,
        "window_start": length - 128 if start is None else start,
        "window_steps": 128,
        "step_median_s": step,
        "step_mean_s": step,
        "split_s": {"forward": step - overhead, "record": overhead, "observe": 0.0, "score": 0.0, "gather": 0.0},
        "eviction_overhead_s": overhead,
        "evictions": 1,
        "tokens_per_s": 1 / step,
        "cumulative_tokens_per_s": 1 / step,
        "slots": 600,
        "kv_bytes": (K + B) * PER_TOKEN if kv is None else kv,
        "peak_memory_bytes": 10**9,
    }


def _record(policy, steps: dict, overhead: dict, *, evicts=True, kv=None):
    return {
        "mode": "sweep",
        "policy": policy,
        "batch": 1,
        "evicts": evicts,
        "kv_bytes_per_token": PER_TOKEN,
        "config": {"budget": K, "buffer": B, "lengths": [1024, 4096], "prompt_length": 32, "window": 128},
        "windows": [_window(n, s, overhead.get(n, 0.0), kv) for n, s in steps.items()],
    }


@pytest.fixture
def records():
    # full: 20 ms at K + B/2 = 576 tokens, slower with length; the others flat or not.
    full = _record("full", {576: 0.020, 1024: 0.024, 4096: 0.040}, {}, evicts=False)
    streaming = _record("streaming", {512: 0.020, 1024: 0.020, 4096: 0.021}, {1024: 0.0001, 4096: 0.0001})
    epikv = _record("epikv", {512: 0.020, 1024: 0.0204, 4096: 0.0206}, {1024: 0.0004, 4096: 0.0005})
    h2o = _record("h2o", {512: 0.020, 1024: 0.022, 4096: 0.030}, {1024: 0.0016, 4096: 0.0020}, kv=(K + B + 1) * 1000)
    return [full, streaming, epikv, h2o]


def test_overhead_ratios_flatness_and_targets(records):
    summary = summarise(records)["sweep"]["1"]
    assert summary["full_reference"] == {"length": 576, "wanted_length": 576, "step_median_s": 0.020}
    epikv, h2o = summary["policies"]["epikv"], summary["policies"]["h2o"]
    # (a) overhead per step over the full step at K + B/2
    assert epikv["overhead_pct"] == {1024: pytest.approx(2.0), 4096: pytest.approx(2.5)}
    assert h2o["overhead_pct_steady"] == pytest.approx(10.0)  # 2 ms / 20 ms, the larger of the two lengths
    # (b) step relative to streaming
    assert epikv["step_vs_streaming"][4096] == pytest.approx(0.0206 / 0.021)
    # (c) flatness: step at 8 K = 4096 over step at K = 512
    assert epikv["flatness"] == {"ratio": pytest.approx(1.03), "long_length": 4096, "short_length": 512}
    assert h2o["flatness"]["ratio"] == pytest.approx(1.5)
    # ... and over the first steady length (1024: its window starts after K + B), where both hold K to K + B
    assert epikv["flatness_steady"] == {
        "ratio": pytest.approx(0.0206 / 0.0204),
        "long_length": 4096,
        "short_length": 1024,
    }
    assert h2o["flatness_steady"]["ratio"] == pytest.approx(0.030 / 0.022)
    # (d) tokens/s relative to full
    assert epikv["tokens_per_s_vs_full"][4096] == pytest.approx(0.040 / 0.0206)
    assert epikv["kv_within_bound"] is True and h2o["kv_within_bound"] is False
    assert "flatness" not in summary["policies"]["full"]

    targets = summary["targets"]
    assert targets["flat_within_10pct"] == {"streaming": True, "epikv": True, "h2o": False}
    assert targets["flat_steady_within_10pct"] == {"streaming": True, "epikv": True, "h2o": False}
    assert targets["overhead_target_pct"] == 2.0
    assert targets["overhead_within_target"] == {"streaming": True, "epikv": False, "h2o": False}  # 2.5%, 10%
    assert targets["kv_within_bound"] == {"streaming": True, "epikv": True, "h2o": False}
    assert targets["cheapest_nontrivial"] == "epikv" and targets["epikv_cheapest"] is True


def test_transformers_cache_is_the_reference_for_bookkeeping_and_attention_free_policies(records):
    plain = _record("transformers", {576: 0.0198, 1024: 0.0236, 4096: 0.040}, {}, evicts=False)
    for record in records:
        record["reads_attention"] = record["policy"] == "h2o"
    plain["reads_attention"] = False
    summary = summarise([records[0], plain, *records[1:]])["sweep"]["1"]
    full = summary["policies"]["full"]
    assert full["tokens_per_s_vs_transformers"] == {1024: pytest.approx(0.0236 / 0.024), 4096: pytest.approx(1.0)}
    targets = summary["targets"]
    assert targets["full_vs_transformers"] == pytest.approx(0.0236 / 0.024)  # the slowest length: 0.983
    assert targets["full_within_2pct_of_transformers"] is True
    # epikv and streaming read no attention (h2o does: not listed); both are faster than the growing plain cache
    assert targets["attention_free_at_least_transformers"] == {"streaming": True, "epikv": True}
    text = markdown([records[0], plain, *records[1:]], summarise([records[0], plain, *records[1:]]), {"machine": {}})
    assert "(e) Tokens/s relative to transformers' own cache" in text
    assert "| full | 0.983 | 1.000 |" in text
    assert "within 2% of transformers' own cache: yes (0.983x at the slowest length)" in text

    slow = _record("transformers", {576: 0.0190, 1024: 0.0200, 4096: 0.020}, {}, evicts=False)  # a faster plain cache
    slow["reads_attention"] = False
    targets = summarise([records[0], slow, *records[1:]])["sweep"]["1"]["targets"]
    assert targets["full_within_2pct_of_transformers"] is False
    assert targets["attention_free_at_least_transformers"] == {"streaming": False, "epikv": False}


def test_markdown_and_printed_summary(records):
    summary = summarise(records)
    meta = {"command": "reasonkv bench ...", "model": "m", "dtype": "bf16", "device": "cpu", "machine": {}}
    text = markdown(records, summary, meta)
    assert "| epikv | 2.00 | 2.50 | 2.50 |" in text  # overhead % at 1024, 4096, steady
    assert "| h2o | 1.500 (4096/512) | 1.364 (4096/1024) |" in text
    assert "missed by h2o" in text
    assert "| epikv | 1024 |" in text
    printed = summary_text(records, summary, meta)
    assert "Overhead summary" in printed and "| epikv | 1024 |" not in printed


def test_eviction_and_max_batch_summaries():
    config = {"cached": 4096, "buffer": 128}
    evictions = [
        {"mode": "eviction-cost", "policy": p, "batch": 1, "mean_s": m, "median_s": m, "std_s": 0.0, "min_s": m}
        | {"score_mean_s": m, "gather_mean_s": 0.0, "repeats": 3, "config": config}
        for p, m in [("streaming", 0.001), ("epikv-lag", 0.002), ("h2o", 0.004)]
    ]
    batch_config = {"memory_limit_bytes": 2**30, "length": 16384, "budget": K, "buffer": B, "probe_batches": [1, 2]}
    model = {"kv_row": 1.0, "other_row": 1.0, "fixed": 1.0, "per_row": 2.0}
    batches = [
        {"mode": "max-batch", "policy": p, "max_batch": b, "measured_batch": b, "tokens_per_s": t, "notes": []}
        | {"memory_model": model, "config": batch_config}
        for p, b, t in [("full", 8, 100.0), ("epikv", 30, 350.0)]
    ]
    summary = summarise(evictions + batches)
    assert summary["eviction_cost"]["cheapest_nontrivial"] == "epikv-lag"
    assert summary["eviction_cost"]["epikv_cheapest"] is True  # a variant counts
    assert summary["max_batch"]["tokens_per_s_vs_full"] == {"full": 1.0, "epikv": 3.5}
    assert summary["max_batch"]["max_batch_vs_full"]["epikv"] == pytest.approx(30 / 8)
    text = markdown(evictions + batches, summary, {"machine": {}})
    assert "| epikv |" in text and "3.50" in text and "## Eviction cost (4096 cached tokens, K = 3968" in text
    assert "One eviction within 1 s (mean): all met." in text
    evictions[2]["mean_s"] = 1.5
    text = markdown(evictions, summarise(evictions), {"machine": {}})
    assert "One eviction within 1 s (mean): missed by h2o." in text


def test_a_sweep_short_of_8_k_states_no_target_at_8_k_and_no_word_on_an_unmeasured_policy():
    short = {"budget": 64, "buffer": 16, "lengths": [128, 256], "prompt_length": 32, "window": 16}
    records = [_record("full", {72: 0.02, 128: 0.021, 256: 0.022}, {}, evicts=False) | {"config": short}]
    records += [
        _record(name, {64: 0.02, 128: 0.02, 256: 0.0201}, {128: 0.0001, 256: 0.0001}) | {"config": short}
        for name in ("streaming", "h2o")
    ]
    summary = summarise(records)
    targets = summary["sweep"]["1"]["targets"]
    assert targets["flat_within_10pct"] == {} and targets["flat_steady_within_10pct"] == {}
    text = markdown(records, summary, {"machine": {}})
    assert "step time at 8 K within +-10% of the step at K: not measured: the longest length, 256, is below " in text
    assert "8 K = 512 (add it to --lengths)" in text and "all met" not in text.split("step time at 8 K")[1][:80]
    assert "- Cheapest policy that scores tokens (besides full, streaming, random): h2o" in text
    assert "epikv not measured" not in text and "EPIKV" not in text


def test_the_sweep_table_shows_the_bytes_held_and_the_bytes_allocated(records):
    for record in records:
        for w in record["windows"]:
            w |= {"kv_bytes_used": 300 * PER_TOKEN, "kv_bytes_quantized": 0, "kv_bytes_sliding": 0}
    text = markdown(records, summarise(records), {"machine": {}})
    assert "| slots | KV held | KV allocated |" in text
    assert "| 600 | 0.3 MiB | 0.6 MiB |" in text  # 300 slots' bytes in use of the (K + B) x 1000 allocated


def test_a_bundled_model_is_named_as_the_quantized_file_it_is(records):
    text = markdown(records, summarise(records), {"model": "smollm2-135m", "machine": {}})
    assert "- model: smollm2-135m, the bundled SmolLM2-135M-Instruct.Q4_1.gguf dequantized on load (" in text
    assert "bundled" not in markdown(records, summarise(records), {"model": "shape:tiny", "machine": {}})
