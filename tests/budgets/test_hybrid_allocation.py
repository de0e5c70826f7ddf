"""Allocations on hybrid models: the budgets are shared over the evicting (full-attention) layers only;
sliding-window layers keep their model's window and linear-attention layers their state, as under ``uniform``.

The oracle holds for every evicting policy under every allocation on every tiny hybrid model, with ragged and
padded heads; the table sums to K x evicting layers x kv-heads; each head holds at most its budget + B; alpha = 1
is the uniform cache exactly; a budget covering everything is the full cache; batch rows of different lengths
stay independent; a budget file names the evicting layers, and one for another count is refused.
"""

from __future__ import annotations

import json

import pytest
import torch

import reasonkv
from conftest import HYBRID_MODELS, SHARED, WINDOW, _tiny, tiny_gemma3, tiny_gpt_oss
from eager_mass import eager_head_mass
from oracle import run_and_check
from reasonkv.cache import CacheSpec
from reasonkv.cache.layer import EvictingLayer
from reasonkv.cache.ragged import RaggedLayer
from reasonkv.calibrate import budgets as calibrate_budgets
from reasonkv.calibrate import shared as calibrate_shared
from reasonkv.calibrate.budgets import BudgetsSettings, head_mass
from reasonkv.hf import cache_keyword, layer_kinds
from reasonkv.policies import get_policy, list_policies

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5 + (7 * i) % 80 for i in range(23)]
ALLOCATIONS = ("pyramid", "adaptive", "calibrated")
EVICTING = [name for name in list_policies() if get_policy(name).evicts]
EVICTING_LAYERS, KV_HEADS = 2, 2  # every tiny hybrid: two full-attention layers (of four), two kv-heads
SMALL = {
    "snapkv": dict(window=4, query_window=4),
    "vase-attnv": dict(window=4, query_window=4),
    "triattention": dict(selection="per-layer-head"),  # its default keeps one set for every layer: refused
}
# The default run's representatives of the oracle grid: each model, each allocation, a few policies.
FAST = {
    ("gemma3", "h2o", "pyramid"),
    ("gemma3", "snapkv", "calibrated"),
    ("gpt-oss", "vase-attnv", "adaptive"),
    ("qwen3-next", "h2o", "calibrated"),
    ("qwen3-next", "snapkv", "adaptive"),
}


def _budget_file(tmp_path, layers: int = EVICTING_LAYERS, heads: int = KV_HEADS, seed: int = 0) -> str:
    """A lopsided calibrated file for the evicting layers: weights drawn at random, one head almost starved."""
    weights = torch.rand(layers, heads, generator=torch.Generator().manual_seed(seed))
    weights[0, 0] = 0.0
    path = tmp_path / f"budgets-{layers}x{heads}.json"
    path.write_text(json.dumps({"layers": layers, "kv_heads": heads, "weights": weights.tolist()}))
    return str(path)


def _settings(allocation: str, tmp_path) -> dict:
    if allocation == "calibrated":
        return {"allocation": allocation, "budgets_file": _budget_file(tmp_path)}
    return {"allocation": allocation}


def _budget(policy: str) -> int:
    """12, or more for a policy whose protected tokens (sinks + window) would leave a static table no room."""
    p = get_policy(policy)
    return max(12, p.sinks + SMALL.get(policy, {}).get("window", p.window) + 6)


def _grid():
    for model in sorted(HYBRID_MODELS):
        for policy in EVICTING:
            for allocation in ALLOCATIONS:
                marks = () if (model, policy, allocation) in FAST else (pytest.mark.slow,)
                yield pytest.param(model, policy, allocation, marks=marks, id=f"{model}-{policy}-{allocation}")


@torch.no_grad()
def _step(model, cache, token_ids) -> torch.Tensor:
    out = model(input_ids=token_ids, use_cache=True, **{cache_keyword(model): cache})
    return out.logits[:, -1]


@pytest.mark.parametrize(("model_name", "policy", "allocation"), list(_grid()))
def test_oracle_under_every_allocation_on_hybrid_models(model_name, policy, allocation, tmp_path):
    """Each step's logits equal the full model's with every evicting (layer, head) masked to the positions it held,
    the sliding layers to their window; and the static tables' heads really hold different numbers."""
    model = HYBRID_MODELS[model_name]()
    prompt = PROMPT[:8] if get_policy(policy).protect_prompt else PROMPT  # a protected prompt must fit K
    settings = {**SMALL.get(policy, {}), **_settings(allocation, tmp_path)}
    cache = run_and_check(
        model, policy, prompt, budget=_budget(policy), buffer=5, steps=24, seed=1, slot_bound=200, **settings
    )
    assert cache.evictions >= 3
    assert cache.evictor.budgets.shape == (EVICTING_LAYERS, KV_HEADS)
    held = torch.stack([cache.head_counts(layer)[0] for layer in cache.full_layers])  # [evicting layers, kv_heads]
    if allocation != "adaptive":
        assert len(set(cache.evictor.budgets.flatten().tolist())) > 1  # uneven, so the oracle tests the split
        assert bool((held <= cache.evictor.budgets + 5).all()), held


@pytest.mark.parametrize(
    ("model_name", "allocation"),
    [
        ("gemma3", "adaptive"),
        pytest.param("gemma3", "pyramid", marks=pytest.mark.slow),
        pytest.param("gpt-oss", "calibrated", marks=pytest.mark.slow),
        pytest.param("qwen3-next", "pyramid", marks=pytest.mark.slow),
    ],
)
def test_the_oracle_holds_with_padded_heads(model_name, allocation, tmp_path):
    """``ragged=False``: every head padded to the widest one in dense buffers, the same attention."""
    cache = run_and_check(
        HYBRID_MODELS[model_name](),
        "snapkv",
        PROMPT,
        budget=12,
        buffer=5,
        steps=24,
        seed=2,
        slot_bound=200,
        ragged=False,
        **SMALL["snapkv"],
        **_settings(allocation, tmp_path),
    )
    assert cache.evictions >= 3
    assert not any(isinstance(cache.layers[i], RaggedLayer) for i in cache.full_layers)


@pytest.mark.parametrize(
    ("model_name", "allocation"),
    [
        ("gemma3", "pyramid"),
        ("qwen3-next", "adaptive"),
        pytest.param("gemma3", "adaptive", marks=pytest.mark.slow),
        pytest.param("gemma3", "calibrated", marks=pytest.mark.slow),
        pytest.param("gpt-oss", "pyramid", marks=pytest.mark.slow),
        pytest.param("gpt-oss", "adaptive", marks=pytest.mark.slow),
        pytest.param("qwen3-next", "calibrated", marks=pytest.mark.slow),
    ],
)
def test_budgets_cover_the_evicting_layers_only(model_name, allocation, tmp_path):
    """The table is [evicting layers, kv-heads] and sums to K x evicting layers x kv-heads; after every eviction
    the heads hold the table (adaptive: each layer's K x kv-heads), between evictions at most their budget + B;
    the evicting layers' bytes held are the budgets + B per head; the sliding layers keep the model's window and
    the other layers their kinds, holding what they hold under ``uniform``."""
    model = HYBRID_MODELS[model_name]()
    budget, buffer = 10, 4
    spec = CacheSpec.build("snapkv", budget, buffer, window=3, seed=1, **_settings(allocation, tmp_path))
    uniform = spec.replace(allocation="uniform", budgets_file=None)
    kinds = layer_kinds(model)
    key_bytes = 2 * 16 * 4  # one token of one kv-head in one layer: keys and values, head_dim 16, float32
    evictions, kept, checked = 0, None, 0
    with (
        reasonkv.EvictingCache(spec=spec, model=model) as cache,
        reasonkv.EvictingCache(spec=uniform, model=model) as plain,
    ):
        assert cache.full_layers == plain.full_layers == [i for i, k in enumerate(kinds) if k == "full"]
        table = cache.evictor.budgets
        assert table.shape == (EVICTING_LAYERS, KV_HEADS) and int(table.sum()) == budget * EVICTING_LAYERS * KV_HEADS
        for index, kind in enumerate(kinds):
            layer = cache.layers[index]
            assert isinstance(layer, RaggedLayer) == (kind == "full")
            assert isinstance(layer, EvictingLayer) == (kind == "full")
            assert type(layer) is type(plain.layers[index]) or kind == "full"
        tokens = torch.tensor([PROMPT])
        for step in range(50):
            logits, _ = _step(model, cache, tokens), _step(model, plain, tokens)
            counts = torch.stack([cache.head_counts(layer)[0] for layer in cache.full_layers])
            if cache.evictions > evictions:
                evictions, kept = cache.evictions, counts
                if allocation == "adaptive":
                    assert counts.sum(1).tolist() == [budget * KV_HEADS] * EVICTING_LAYERS
                else:
                    assert torch.equal(counts, table)
                expected = (budget + buffer) * EVICTING_LAYERS * KV_HEADS * key_bytes
                assert cache.kv_bytes_by_kind()["full"] == expected  # measured from the regions' tensors
                checked += 1
            limit = (table if kept is None or allocation != "adaptive" else kept) + buffer
            assert bool((counts <= limit).all()), (step, counts, limit)
            held, theirs = cache.kv_bytes_by_kind(), plain.kv_bytes_by_kind()
            assert (held["sliding"], held["linear"]) == (theirs["sliding"], theirs["linear"])
            for index, kind in enumerate(kinds):
                if kind == "sliding":  # the model's window: the last window - 1 positions
                    newest = cache.seen - 1
                    want = list(range(newest - WINDOW + 2, newest + 1))
                    for head in cache.positions(index)[0]:
                        assert head[head >= 0].tolist() == want
            tokens = logits.argmax(-1, keepdim=True)
    assert checked >= 8


@pytest.mark.parametrize(
    ("model_name", "policy"),
    [
        ("gemma3", "h2o"),
        ("gpt-oss", "snapkv"),
        pytest.param("qwen3-next", "vase-attnv", marks=pytest.mark.slow),
        pytest.param("gemma3", "random", marks=pytest.mark.slow),
        pytest.param("gpt-oss", "epikv", marks=pytest.mark.slow),
        pytest.param("qwen3-next", "triattention", marks=pytest.mark.slow),
    ],
)
def test_adaptive_with_alpha_one_is_the_uniform_cache_bit_for_bit(model_name, policy):
    """alpha = 1: every head's floor is K, so the adaptive split keeps exactly what the uniform cache keeps, in
    every evicting layer and head at every step, and the same tokens come out. (The logits agree to rounding: the
    attention reads the same keys through a per-head mask instead of the row's.)"""
    model = HYBRID_MODELS[model_name]()
    budget = 12 + get_policy(policy).sinks + get_policy(policy).window
    base = CacheSpec.build(policy, budget, 5, seed=7, **SMALL.get(policy, {}))
    adaptive = base.replace(allocation="adaptive", adaptive_alpha=1.0)
    with (
        reasonkv.EvictingCache(spec=base, model=model) as plain,
        reasonkv.EvictingCache(spec=adaptive, model=model) as cache,
    ):
        tokens, compared = torch.tensor([PROMPT + PROMPT[:10]]), 0
        for _ in range(40):
            want, got = _step(model, plain, tokens), _step(model, cache, tokens)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert torch.equal(want.argmax(-1), got.argmax(-1))
            assert plain.evictions == cache.evictions
            for layer in plain.full_layers:
                theirs, ours = plain.positions(layer)[0], cache.positions(layer)[0]
                assert [sorted(h[h >= 0].tolist()) for h in theirs] == [sorted(h[h >= 0].tolist()) for h in ours]
                compared += 1
            tokens = want.argmax(-1, keepdim=True)
    assert plain.evictions > 3 and compared == 40 * EVICTING_LAYERS


def _gemma3_one_kv_head():
    """The tiny Gemma 3 with one kv-head per layer, as the bundled Gemma 3 270M has."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **{**SHARED, "num_key_value_heads": 1},
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
    )
    return _tiny(config, Gemma3ForCausalLM, "sdpa", torch.float32, 0)


@pytest.mark.parametrize("policy", ["h2o", pytest.param("snapkv", marks=pytest.mark.slow)])
def test_adaptive_is_uniform_with_one_kv_head_per_layer(policy):
    """AdaKV shares each layer's K x kv-heads among its heads: with one kv-head (Gemma 3 270M) that head keeps
    K, whatever alpha, so adaptive is the uniform cache."""
    model = _gemma3_one_kv_head()
    kwargs = dict(max_new_tokens=40, chat=False, ignore_eos=True)
    base = CacheSpec.build(policy, 12, 5, seed=3, **SMALL.get(policy, {}))
    runs = {}
    for allocation in ("uniform", "adaptive"):
        spec = base if allocation == "uniform" else base.replace(allocation=allocation, adaptive_alpha=0.0)
        [runs[allocation]] = reasonkv.generate(model, None, [PROMPT], spec=spec, **kwargs)
    assert runs["adaptive"].token_ids == runs["uniform"].token_ids
    assert runs["adaptive"].stats["evictions"] == runs["uniform"].stats["evictions"] > 3


@pytest.mark.parametrize("model_name", [*sorted(HYBRID_MODELS)])
@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_a_budget_covering_everything_is_the_full_cache(model_name, allocation, tmp_path):
    """Every head's budget above the run's tokens: nothing is evicted, and the output is the full cache's, read
    through the ragged regions and the per-head masks."""
    model = HYBRID_MODELS[model_name]()
    kwargs = dict(max_new_tokens=25, chat=False, ignore_eos=True)
    [full] = reasonkv.generate(model, None, [PROMPT], **kwargs)
    budget, settings = 100, {"allocation": allocation}
    if allocation == "pyramid":  # the top layer keeps K // 20
        budget = 20 * (len(PROMPT) + 25 + 10)
    if allocation == "calibrated":  # lopsided integer budgets, each above the run's 48 tokens
        path = tmp_path / "covering.json"
        path.write_text(json.dumps({"layers": 2, "kv_heads": 2, "budgets": [[150, 60], [90, 100]]}))
        settings["budgets_file"] = str(path)
    spec = CacheSpec.build("snapkv", budget, 8, window=4, **settings)
    [ours] = reasonkv.generate(model, None, [PROMPT], spec=spec, **kwargs)
    assert ours.token_ids == full.token_ids and ours.stats["evictions"] == 0
    assert ours.stats["allocation"] == allocation


@pytest.mark.parametrize(
    ("model_name", "allocation", "ragged"),
    [
        ("gemma3", "adaptive", True),
        ("qwen3-next", "pyramid", False),
        pytest.param("gemma3", "pyramid", True, marks=pytest.mark.slow),
        pytest.param("gemma3", "calibrated", False, marks=pytest.mark.slow),
        pytest.param("gpt-oss", "adaptive", True, marks=pytest.mark.slow),
        pytest.param("gpt-oss", "calibrated", True, marks=pytest.mark.slow),
        pytest.param("qwen3-next", "adaptive", True, marks=pytest.mark.slow),
        pytest.param("qwen3-next", "calibrated", True, marks=pytest.mark.slow),
    ],
)
def test_batch_rows_of_different_lengths_stay_independent(model_name, allocation, ragged, tmp_path):
    """Left-padded prompts of different lengths, evicted at different steps: each row gives what it gives alone
    (the sliding layers' padding and each head's own padding both masked)."""
    model = HYBRID_MODELS[model_name]()
    prompts = [PROMPT + PROMPT[:9], PROMPT[5:19], PROMPT[3:]]
    settings = _settings(allocation, tmp_path)
    spec = CacheSpec.build("snapkv", 14, 5, window=3, seed=[1, 2, 3], ragged=ragged, **settings)
    kwargs = dict(max_new_tokens=30, chat=False, ignore_eos=True)
    together = reasonkv.generate(model, None, prompts, spec=spec, **kwargs)
    for index, (prompt, row) in enumerate(zip(prompts, together, strict=True)):
        [alone] = reasonkv.generate(model, None, [prompt], spec=spec.replace(seed=spec.seed[index]), **kwargs)
        assert row.token_ids == alone.token_ids, index
        assert row.stats["evictions"] == alone.stats["evictions"] > 3


def test_compiled_decode_runs_eagerly_and_says_why():
    model = tiny_gemma3()
    spec = CacheSpec.build("snapkv", 12, 5, window=3, allocation="pyramid")
    kwargs = dict(spec=spec, max_new_tokens=25, chat=False, ignore_eos=True)
    [compiled] = reasonkv.generate(model, None, [PROMPT], compile=True, **kwargs)
    [eager] = reasonkv.generate(model, None, [PROMPT], **kwargs)
    assert compiled.stats["compile"]["eager_reason"]
    assert compiled.token_ids == eager.token_ids and compiled.stats["evictions"] > 0


def test_a_budget_file_for_another_layer_count_is_refused(tmp_path):
    """A file for every layer of the model (4) instead of its evicting layers (2) names both counts."""
    path = _budget_file(tmp_path, layers=4)
    with pytest.raises(ValueError, match=r"is for 4 layers x 2 kv-heads, but the model has 2 full-attention layers"):
        reasonkv.EvictingCache(12, 4, model=tiny_gemma3(), policy="h2o", allocation="calibrated", budgets_file=path)


@pytest.mark.parametrize("factory", [lambda: tiny_gemma3(softcap=20.0), tiny_gpt_oss], ids=["gemma3", "gpt-oss"])
def test_calibrated_mass_is_the_kernels_on_the_evicting_layers(factory):
    """On a hybrid model the file's rows are the full-attention layers; the mass is the kernel's own softmax,
    soft-capping and learned sinks included."""
    model = factory()
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in (40, 25)]
    got, queries = head_mass(model, sequences, sinks=2, window=5)
    assert got.shape == (EVICTING_LAYERS, KV_HEADS) and queries == (40 - 7) + (25 - 7)
    torch.testing.assert_close(got, eager_head_mass(model, sequences, 2, 5), atol=1e-5, rtol=1e-4)


def test_calibrate_budgets_writes_the_evicting_layers_and_the_cache_reads_them(tmp_path, monkeypatch):
    model = tiny_gemma3()
    monkeypatch.setattr(calibrate_shared, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(calibrate_budgets, "read_sequences", lambda settings, tokenizer: [list(range(3, 60))])
    out = tmp_path / "budgets.json"
    assert calibrate_budgets.run_budgets(BudgetsSettings(model="tiny", sinks=2, window=8, out=out)) == 0
    record = json.loads(out.read_text())
    assert (record["layers"], record["kv_heads"]) == (EVICTING_LAYERS, KV_HEADS)
    spec = CacheSpec.build("h2o", 12, 4, allocation="calibrated", budgets_file=str(out))
    [result] = reasonkv.generate(model, None, [PROMPT + PROMPT], spec=spec, max_new_tokens=20, chat=False)
    assert result.stats["evictions"] > 0 and result.stats["allocation"] == "calibrated"
