"""Selection as a cache mode: every token held, each decode step reads the chosen blocks within the budget."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama, tiny_qwen3
from reasonkv.bench.plan import build_plan
from reasonkv.bench.settings import BenchSettings
from reasonkv.cache import CacheSpec, EvictingCache
from reasonkv.cli import generate as cli_generate
from reasonkv.cli.main import build_parser
from reasonkv.eval.grid import GridSpec, make_cells
from reasonkv.generation.compiled import CompiledDecode
from reasonkv.hf import Forward, left_pad
from reasonkv.selection import PooledKeys, pool_keys

LENGTHS = (150, 97, 131)  # a ragged, left-padded batch


def _prompts(seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.mark.slow  # the step-by-step logits oracle below is the fast representative
@pytest.mark.parametrize("policy", ["quest"])
def test_a_budget_covering_every_block_decodes_as_the_full_cache(policy):
    model, prompts = tiny_qwen3(layers=3), _prompts()
    full = reasonkv.generate(model, None, prompts, policy="full", max_new_tokens=140, ignore_eos=True)
    chosen = reasonkv.generate(model, None, prompts, policy=policy, budget=64 * 8, max_new_tokens=140, ignore_eos=True)
    for a, b in zip(full, chosen, strict=True):
        assert a.token_ids == b.token_ids
        assert b.stats["evictions"] == 0
        assert b.stats["selection"]["read_fraction"] == 1.0


def test_the_oracle_holds_for_logits_step_by_step():
    """Every decode step's logits equal the full cache's, over a ragged batch and 100 steps crossing blocks."""
    model, prompts = tiny_llama(layers=3), _prompts(2)
    ids, mask = left_pad(prompts, 0, "cpu")
    forward = Forward(model)
    caches = [
        EvictingCache(model=model, spec=CacheSpec.build("full")),
        EvictingCache(model=model, spec=CacheSpec.build("quest", 64 * 6, block_size=32)),
    ]
    with torch.inference_mode():
        logits = [forward(ids, c, attention_mask=mask).logits[:, -1] for c in caches]
        for _ in range(100):
            torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=2e-6)
            token = logits[0].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = [forward(token, c, attention_mask=mask).logits[:, -1] for c in caches]
    for c in caches:
        c.detach()


def test_a_small_budget_reads_less_and_holds_everything():
    model, prompts = tiny_llama(layers=3), _prompts(3)
    out = reasonkv.generate(
        model, None, prompts, policy="quest", budget=64, dense_layers=0, max_new_tokens=80, ignore_eos=True
    )
    for row, result in zip(prompts, out, strict=True):
        stats = result.stats["selection"]
        assert result.stats["evictions"] == 0
        assert result.stats["peak_row_tokens"] == len(row) + 79  # every token held
        # Each (layer, kv-head) reads at most 64 tokens a step: 3 layers x 2 kv-heads, K and V of 16 float32 each.
        assert 0 < stats["kv_bytes_read_per_step"] <= 3 * 2 * 64 * (2 * 16 * 4)
        assert stats["kv_bytes_full_read_per_step"] > 2 * stats["kv_bytes_read_per_step"]
        assert 0 < stats["read_fraction"] < 0.5


def test_the_pooled_side_cache_equals_pooling_the_full_keys_at_every_step():
    model, prompts = tiny_qwen3(layers=2), _prompts(4)
    checked = []

    def check(step, cache):
        selector = cache.evictor.selector
        for layer in cache.full_layers:
            keys = cache.layers[layer].keys
            positions = cache.layers[layer].positions[:, 0]
            low, high, total, counts = pool_keys(keys, positions, 16)
            pooled: PooledKeys = selector.pooled[layer]
            assert pooled.blocks == low.shape[2]
            torch.testing.assert_close(pooled.minimum, low, rtol=0, atol=0)
            torch.testing.assert_close(pooled.maximum, high, rtol=0, atol=0)
            torch.testing.assert_close(pooled.total, total, rtol=1e-5, atol=1e-5)
            assert torch.equal(pooled.counts, counts)
        checked.append(step)

    reasonkv.generate(
        model,
        None,
        prompts,
        policy="quest",
        budget=64,
        dense_layers=0,  # a dense layer keeps no side cache
        max_new_tokens=60,
        ignore_eos=True,
        on_step=check,
    )
    assert checked == list(range(60))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(budget=8), "at least one block"),
        (dict(budget=None), "needs a budget"),
        (dict(budget=256, sinks=4), "sinks=4"),
        (dict(budget=256, quantized=64), "no quantized tier"),
        (dict(budget=256, block_size=0), "block_size"),
    ],
)
def test_bad_settings_are_refused_with_the_value_and_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec.build("quest", **options)


REFUSED_COMPILED = "policy '{}' chooses the blocks a decode step reads .* without compile"


@pytest.mark.parametrize("policy", ["quest", "seer"])
def test_the_spec_refuses_a_compiled_decode_and_generate_asks_it(policy):
    """A compiled step does not call the kernel reader, so it would read every token held."""
    with pytest.raises(ValueError, match=REFUSED_COMPILED.format(policy)):
        CacheSpec.build(policy, 64).check_compile()
    CacheSpec.build("h2o", 64).check_compile()  # an evicting cache compiles
    with pytest.raises(ValueError, match=REFUSED_COMPILED.format(policy)):
        reasonkv.generate(tiny_llama(layers=2), None, [[5, 6, 7]], policy=policy, budget=64, compile=True)


def test_the_generate_command_refuses_a_compiled_selection_before_the_model_loads(monkeypatch):
    monkeypatch.setattr(cli_generate, "load_model_from", lambda args: pytest.fail("the model was loaded"))
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--policy", "quest", "--budget", "64", "--compile"])
    with pytest.raises(ValueError, match=REFUSED_COMPILED.format("quest")):
        cli_generate.run(args)


def test_the_compiled_step_itself_refuses_a_selecting_cache():
    """What the bench's prefilled sweep builds directly, without generate."""
    model = tiny_llama(layers=2)
    cache = EvictingCache(model=model, spec=CacheSpec.build("quest", 64))
    with cache, pytest.raises(ValueError, match=REFUSED_COMPILED.format("quest")):
        CompiledDecode(model, cache, backend="eager")


@pytest.mark.parametrize("policy", ["quest", "seer"])
def test_the_bench_plan_refuses_a_compiled_selection_policy(tmp_path, policy):
    common = dict(model="shape:tiny", out=tmp_path / "x", lengths="384,448", decode_steps=64, budget=64, buffer=16)
    for prefilled in (False, True):
        settings = BenchSettings(**common, policies=f"full,h2o,{policy}", compile=True, prefill_to_length=prefilled)
        with pytest.raises(ValueError, match="--compile: " + REFUSED_COMPILED.format(policy)):
            build_plan(settings)
    # Under --policies all it is measured eagerly only, and the warning says why.
    everything = build_plan(BenchSettings(**common, policies="all", compile=True, prefill_to_length=True))
    assert policy in everything.policies and f"{policy}~compiled" not in everything.policies
    assert "h2o~compiled" in everything.compiled and f"{policy}~compiled" not in everything.compiled
    assert any(w.startswith(f"skipping {policy}~compiled: policy '{policy}'") for w in everything.warnings)


@pytest.mark.parametrize("policy", ["quest", "seer"])
def test_the_eval_grid_refuses_a_compiled_selection_cell_when_built(policy):
    with pytest.raises(ValueError, match=REFUSED_COMPILED.format(policy)):
        GridSpec.build(dataset="gsm8k:2", policies=f"full,{policy}", budgets=[64], compile=True)
    assert GridSpec.build(dataset="gsm8k:2", policies="full,h2o", budgets=[64], compile=True).compile


def test_a_trace_records_what_each_step_read():
    model, prompts = tiny_llama(layers=2), _prompts(5)[:2]
    out = reasonkv.generate(
        model, None, prompts, policy="quest", budget=48, dense_layers=1, max_new_tokens=30, ignore_eos=True, trace=True
    )
    for prompt, result in zip(prompts, out, strict=True):
        trace = result.trace
        assert trace.settings["selects"] and len(trace.evictions) == 29  # every decode step
        for step, record in enumerate(trace.evictions):
            assert record.seen == len(prompt) + step + 1
            read, held = record.kept_mask(), record.before_mask()
            assert held.all()  # selection holds every token
            assert read[0].all()  # the dense layer reads everything
            assert (read[1].sum(-1) <= 48).all() and read[..., -1].all()  # within the budget, the newest token read
            assert not (record.protected_mask() & ~read).any()  # the current block is always read
            assert record.scores.shape == (2, 2, record.seen)


def test_an_eval_grid_measures_selection_cells_at_every_budget_beside_eviction():
    cells = make_cells("full,quest,h2o", [128, 256], buffer=32)
    named = [(c.policy, c.budget, c.evicts) for c in cells]
    assert named[0] == ("full", None, False)  # the reference first
    assert ("quest", 128, True) in named and ("quest", 256, True) in named
    assert ("h2o", 128, True) in named
    with pytest.raises(ValueError, match="give at least one budget"):
        make_cells("full,quest", [])
