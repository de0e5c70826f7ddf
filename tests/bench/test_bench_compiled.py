"""``reasonkv bench --compile``: every policy again as ``POLICY~compiled`` beside its eager entry, and plain
transformers eager and compiled, in one run; the steps that compiled a graph stay out of tokens/s.

The backends here are dynamo's ``eager`` and ``aot_eager`` (graph capture without code generation: seconds);
tests/test_compiled.py runs inductor itself.
"""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import tiny_llama
from reasonkv.bench.measure import StepRecorder, measure_sweep
from reasonkv.bench.plan import build_plan
from reasonkv.bench.settings import BenchSettings
from reasonkv.cache import CacheSpec
from reasonkv.cli import main
from reasonkv.generation.compiled import StaticStep
from reasonkv.hf import Forward, native_cache, plain_cache
from reasonkv.policies import get_policy

TINY = ["bench", "--model", "shape:tiny", "--dtype", "fp32", "--no-progress", "--no-plots"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def collected():
    """Collect the garbage around each test: a compiled step leaves its model's attention tap registered until
    the model is collected, and a collection that lands inside the next test's tracing would swap the
    attention kernel under dynamo's guards."""
    gc.collect()
    yield
    gc.collect()


@pytest.mark.slow
def test_compiled_variants_run_beside_their_policies_with_the_transformers_pair(tmp_path, capsys):
    out = tmp_path / "compiled"
    args = [*TINY, "--policies", "streaming", "--lengths", "96", "--prefill-to-length", "--decode-steps", "32"]
    args += ["--budget", "32", "--buffer", "16", "--compile", "aot_eager", "--rounds", "2", "--out", str(out)]
    assert main(args) == 0
    assert "Compiled against eager decoding (batch 1)" in capsys.readouterr().out
    document = json.loads((out / "bench.json").read_text(), parse_constant=pytest.fail)
    assert "--compile aot_eager" in document["command"]
    records = {r["policy"]: r for r in document["records"]}
    assert set(records) == {"full", "transformers", "streaming", *(p + "~compiled" for p in records if "~" not in p)}
    for name in ("full~compiled", "streaming~compiled", "transformers~compiled"):
        ran = records[name]["compile"]
        assert ran["compiled"] and ran["backend"] == "aot_eager" and ran["eager_reason"] is None
        assert ran["compilations"] >= 1 and ran["warmup_seconds"] > 0
    assert "compile" not in records["streaming"]
    assert records["streaming~compiled"]["config"]["compile"] == "aot_eager"
    [eager] = [w for w in records["streaming"]["windows"] if w["length"] == 96]
    [compiled] = [w for w in records["streaming~compiled"]["windows"] if w["length"] == 96]
    [static] = [w for w in records["transformers~compiled"]["windows"] if w["length"] == 96]
    assert compiled["evictions"] == eager["evictions"] == 2  # 32 steps, B = 16: the variant evicts as the policy
    assert compiled["rounds"]["count"] == eager["rounds"]["count"] == 2  # compiled and eager interleaved
    assert compiled["kv_bytes"] == eager["kv_bytes"]  # the static layout holds K + B slots, as the eager cache
    summary = document["summary"]["compiled"]["1"]["streaming~compiled"]
    assert summary["compiled_vs_eager"]["96"] == pytest.approx(compiled["tokens_per_s"] / eager["tokens_per_s"])
    assert summary["vs_transformers_compiled"]["96"] == pytest.approx(compiled["tokens_per_s"] / static["tokens_per_s"])
    assert summary["warmup_seconds"] == records["streaming~compiled"]["compile"]["warmup_seconds"]
    sweep = document["summary"]["sweep"]["1"]["policies"]
    # A compiled entry is set against transformers compiled, an eager one against transformers eager.
    assert sweep["streaming~compiled"]["tokens_per_s_vs_transformers"]["96"] == pytest.approx(
        summary["vs_transformers_compiled"]["96"]
    )
    assert "| streaming | 96 |" in (out / "bench.md").read_text()


def test_the_steps_that_compiled_are_left_out_of_the_window():
    cache = plain_cache()
    recorder = StepRecorder(device=torch.device("cpu"), prompt_length=10, windows={14: 10}, batch=2)
    recorder(0, cache)
    for step in range(1, 5):
        if step == 2:  # this step traces a graph: it takes long
            counters["stats"]["unique_graphs"] += 1
            time.sleep(0.05)
        recorder(step, cache)
    assert recorder.compiling_steps == {1}
    assert recorder.warmup_seconds() >= 0.05
    window = recorder.window(14)
    kept = [s for i, s in enumerate(recorder.step_seconds) if i != 1]
    assert window["window_steps"] == 3 and window["compiling_steps_excluded"] == 1
    assert window["tokens_per_s"] == pytest.approx(2 / (sum(kept) / 3))
    assert window["step_max_s"] < 0.05


def test_a_compiled_decode_sweep_reports_its_compilation_apart():
    model = tiny_llama(layers=2)
    spec = CacheSpec(get_policy("streaming"), 16, 8)
    data = measure_sweep(model, spec, batch=2, prompt_length=8, lengths=[40], window=32, compile="eager")
    assert data["compile"]["compiled"] and data["compile"]["compilations"] >= 1
    [window] = data["windows"]
    # The window covers every decode step; the first one traced the graph and is left out.
    assert window["compiling_steps_excluded"] >= 1
    assert window["window_steps"] == 32 - window["compiling_steps_excluded"]
    assert data["totals"]["decode_steps"] == 32


def test_the_compiled_transformers_reference_decodes_as_transformers_eager():
    model = tiny_llama(layers=2)
    ids = torch.randint(10, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    forward, cache = Forward(model), native_cache(model)
    reference = StaticStep(model, 20 + 12, backend="eager")
    with torch.inference_mode():
        eager = forward(ids, cache, last_logits_only=True).logits[:, -1]
        static = reference.prefill(ids)
        tokens = []
        for _ in range(12):
            a, b = eager.argmax(-1, keepdim=True), static.argmax(-1, keepdim=True)
            assert torch.equal(a, b)
            tokens.append(a)
            eager = forward(a, cache, last_logits_only=True).logits[:, -1]
            static = reference(b)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


def test_compile_settings_are_checked_and_recorded_only_when_asked_for(tmp_path):
    common = dict(model="shape:tiny", dtype="fp32", policies="streaming", out=tmp_path / "x", lengths="96")
    with pytest.raises(ValueError, match="--compile: compile must be True, False or a torch.compile backend .*'nope'"):
        BenchSettings(**common, compile="nope")
    with pytest.raises(ValueError, match="--compile needs the length sweep"):
        BenchSettings(**{**common, "lengths": None}, eviction_cost=True, cached=64, buffer=16, compile=True)
    plain = build_plan(BenchSettings(**common))
    assert "compile" not in plain.configs["sweep"] and plain.compiled == {}  # old folders resume as before
    decoded = build_plan(BenchSettings(**common, compile=True))
    assert decoded.configs["sweep"]["compile"] == "inductor"
    assert decoded.compiled == {"full~compiled": "full", "streaming~compiled": "streaming"}  # no transformers pair
    assert decoded.policies == ["full", "full~compiled", "streaming", "streaming~compiled"]  # each beside its entry
    assert "--compile" in decoded.settings.command().split()
    prefilled = build_plan(BenchSettings(**common, compile="eager", prefill_to_length=True, decode_steps=32))
    assert prefilled.compiled["transformers~compiled"] == "transformers"
    assert "transformers" in prefilled.policies and prefilled.specs["sweep"]["transformers~compiled"] is None


def test_a_bad_compile_backend_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([*TINY, "--lengths", "96", "--compile", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "--compile" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
