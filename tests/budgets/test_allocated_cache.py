"""Eviction under an allocation: the policy ranks, the allocation decides how many each head keeps.

The oracle holds (each head attends to exactly what it holds), every registered policy runs under every
allocation, each head holds at most its budget + B, the layer totals are the uniform cache's, the adaptive
split with alpha = 1 is today's uniform cache bit for bit, and batch rows stay independent.
"""

from __future__ import annotations

import json

import pytest
import torch

import reasonkv
from conftest import fast_few, tiny_llama, tiny_qwen3
from oracle import run_and_check
from reasonkv.cache import CacheSpec
from reasonkv.eval.fidelity import trace_fidelity
from reasonkv.eval.grid import make_cells
from reasonkv.hf import cache_keyword
from reasonkv.policies import get_policy, list_policies

PROMPT = [5 + (7 * i) % 80 for i in range(40)]
STATIC = ("pyramid", "calibrated")
EVICTING = [name for name in list_policies() if get_policy(name).evicts]
FAST = ("h2o", "vase-attnv")
# A policy that keeps one token set for every layer takes its per-layer option under an allocation.
PER_LAYER = {"triattention": {"selection": "per-layer-head"}}


def _budget(policy: str) -> int:
    """A budget that leaves room beyond the policy's protected tokens (the whole prompt, for one that protects it)."""
    p = get_policy(policy)
    return p.sinks + p.window + 10 + (len(PROMPT) if p.protect_prompt else 0)


def _budget_file(tmp_path, layers: int, heads: int, seed: int = 0) -> str:
    """A lopsided calibrated file: weights drawn at random, one head almost starved."""
    weights = torch.rand(layers, heads, generator=torch.Generator().manual_seed(seed))
    weights[0, 0] = 0.0
    path = tmp_path / f"budgets-{layers}x{heads}.json"
    path.write_text(json.dumps({"layers": layers, "kv_heads": heads, "weights": weights.tolist()}))
    return str(path)


def _settings(allocation: str, tmp_path, layers: int = 4, heads: int = 2) -> dict:
    if allocation == "calibrated":
        return {"allocation": allocation, "budgets_file": _budget_file(tmp_path, layers, heads)}
    return {"allocation": allocation}


def _policies(fast):
    return [p if p in fast else pytest.param(p, marks=pytest.mark.slow) for p in EVICTING]


@pytest.mark.parametrize("allocation", ["pyramid", "adaptive", "calibrated"])
@pytest.mark.parametrize("policy", _policies(FAST))
def test_every_policy_attends_to_what_each_head_holds(policy, allocation, tmp_path):
    """The oracle, for every registered policy under every allocation: the logits of each step equal the full
    model's with every (layer, head) masked to the positions it held."""
    model = tiny_llama(layers=4)
    budget = _budget(policy)
    prompt = PROMPT if get_policy(policy).protect_prompt else PROMPT + PROMPT[: budget // 2]
    cache = run_and_check(
        model,
        policy,
        prompt,
        budget=budget,
        buffer=6,
        steps=30,
        slot_bound=10 * budget,
        seed=3,
        **PER_LAYER.get(policy, {}),
        **_settings(allocation, tmp_path),
    )
    assert cache.evictions >= 2


@pytest.mark.parametrize("allocation", ["pyramid", "adaptive", "calibrated"])
def test_a_policy_keeping_one_set_for_every_layer_is_refused_naming_its_per_layer_option(allocation, tmp_path):
    shared = [name for name in EVICTING if get_policy(name).layers_share_kept_set() is not None]
    assert shared == ["triattention"]
    refusal = r"its own budget, but 'triattention' with selection='per-head'.*per-layer-head"
    with pytest.raises(ValueError, match=refusal):  # by the spec, before any model loads
        CacheSpec.build("triattention", 12, 4, **_settings(allocation, tmp_path))
    with pytest.raises(ValueError, match=refusal):
        budgets_file = _settings(allocation, tmp_path).get("budgets_file")
        make_cells(
            ["full", "h2o", "triattention"], [12], 4, allocations=["uniform", allocation], budgets_file=budgets_file
        )
    assert CacheSpec.build("triattention", 12, 4, selection="per-layer-head", **_settings(allocation, tmp_path))


@pytest.mark.parametrize(
    "allocation",
    [pytest.param("pyramid", marks=pytest.mark.slow), "adaptive", pytest.param("calibrated", marks=pytest.mark.slow)],
)
def test_heads_hold_at_most_their_budget_plus_b_and_the_totals_are_uniforms(allocation, tmp_path):
    model = tiny_qwen3(layers=5, kv_heads=2, heads=4)
    budget, buffer = 14, 5
    spec = CacheSpec.build("snapkv", budget, buffer, window=3, seed=1, **_settings(allocation, tmp_path, 5, 2))
    table = spec.budget_table(5, 2)
    assert int(table.sum()) == budget * 5 * 2
    key = cache_keyword(model)
    kept: torch.Tensor | None = None  # [layers, heads] right after the last eviction
    evictions, distinct = 0, set()
    with reasonkv.EvictingCache(spec=spec, model=model) as cache:
        out = model(input_ids=torch.tensor([PROMPT]), use_cache=True, **{key: cache})
        for _ in range(60):
            counts = torch.stack([cache.head_counts(layer)[0] for layer in cache.full_layers])
            if cache.evictions > evictions:  # an eviction just ran: the layer totals are the uniform cache's
                evictions, kept = cache.evictions, counts
                distinct.add(tuple(counts.flatten().tolist()))
                if allocation == "adaptive":
                    assert counts.sum(1).tolist() == [budget * 2] * 5
                    assert int(counts.min()) >= 3  # the floor: ceil(0.2 x 14)
                else:
                    assert torch.equal(counts, table)
            limit = (table if kept is None or allocation != "adaptive" else kept) + buffer
            assert bool((counts <= limit).all()), (counts, limit)
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, use_cache=True, **{key: cache})
    assert evictions >= 8
    if allocation != "adaptive":
        assert len(distinct) == 1
    # The storage pads every head to the widest one: what it allocates is measured, not computed.
    assert cache.kv_bytes() >= 2 * 5 * 2 * (int(table.max()) + buffer) * 8 * 4


@pytest.mark.parametrize("policy", fast_few(["h2o", "snapkv", "vase-attnv", "epikv", "random", "triattention"]))
def test_adaptive_with_alpha_one_is_the_uniform_cache_bit_for_bit(policy):
    """alpha = 1: every head's floor is K, so the adaptive split is today's uniform cache exactly."""
    model = tiny_llama(layers=3)
    budget = _budget(policy)
    prompt = PROMPT + PROMPT[: budget // 2]
    runs = []
    for settings in ({}, {"allocation": "adaptive", "adaptive_alpha": 1.0}):
        spec = CacheSpec.build(policy, budget, 5, seed=7, **PER_LAYER.get(policy, {}), **settings)
        [result] = reasonkv.generate(model, None, [prompt], spec=spec, max_new_tokens=40, chat=False, ignore_eos=True)
        runs.append(result)
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats["evictions"] == runs[1].stats["evictions"] > 3


def test_adaptive_at_a_budget_covering_everything_is_the_full_cache():
    model = tiny_llama(layers=3)
    full = reasonkv.generate(model, None, [PROMPT], max_new_tokens=30, chat=False, ignore_eos=True)[0]
    spec = CacheSpec.build("snapkv", len(PROMPT) + 30, 8, window=4, allocation="adaptive")
    ours = reasonkv.generate(model, None, [PROMPT], spec=spec, max_new_tokens=30, chat=False, ignore_eos=True)[0]
    assert ours.token_ids == full.token_ids and ours.stats["evictions"] == 0


@pytest.mark.parametrize("allocation", [pytest.param("pyramid", marks=pytest.mark.slow), "adaptive"])
def test_batch_rows_of_different_lengths_stay_independent(allocation):
    model = tiny_llama(layers=3)
    prompts = [PROMPT, PROMPT[5:29], PROMPT[11:]]
    spec = CacheSpec.build("snapkv", 16, 5, window=3, seed=[1, 2, 3], allocation=allocation)
    kwargs = dict(max_new_tokens=40, chat=False, ignore_eos=True)
    together = reasonkv.generate(model, None, prompts, spec=spec, **kwargs)
    for index, (prompt, row) in enumerate(zip(prompts, together, strict=True)):
        alone_spec = spec.replace(seed=spec.seed[index])
        [alone] = reasonkv.generate(model, None, [prompt], spec=alone_spec, **kwargs)
        assert row.token_ids == alone.token_ids, index
        assert row.stats["evictions"] == alone.stats["evictions"] > 3


def test_an_allocation_refuses_what_it_cannot_hold():
    model = tiny_llama(layers=2)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="through the sdpa or eager attention kernel"):
        reasonkv.EvictingCache(12, 4, model=model, policy="h2o", allocation="pyramid")


def test_compiled_decode_says_it_runs_eagerly_under_an_allocation():
    model = tiny_llama(layers=2)
    spec = CacheSpec.build("snapkv", 16, 5, window=3, allocation="adaptive")
    kwargs = dict(spec=spec, max_new_tokens=30, chat=False, ignore_eos=True)
    [compiled] = reasonkv.generate(model, None, [PROMPT], compile=True, **kwargs)
    [eager] = reasonkv.generate(model, None, [PROMPT], **kwargs)
    assert "an allocation gives each kv-head its own mask" in compiled.stats["compile"]["eager_reason"]
    assert compiled.token_ids == eager.token_ids


def test_selection_policies_are_refused_clearly():
    """(Hybrid models are held: tests/budgets/test_hybrid_allocation.py.)"""
    with pytest.raises(ValueError, match="applies to evicting policies, not to 'quest'"):
        reasonkv.EvictingCache(64, 4, model=tiny_llama(layers=2), policy="quest", allocation="pyramid")


@pytest.mark.parametrize("allocation", ["adaptive", "pyramid"])
def test_buffer_zero_evicts_every_step_and_holds_the_oracle(allocation):
    """B = 0 (H2O's one-token greedy schedule) and alpha = 0 (a head may keep nothing beyond the others')."""
    cache = run_and_check(
        tiny_llama(layers=4),
        "snapkv",
        PROMPT,
        budget=10,
        buffer=0,
        steps=20,
        slot_bound=100,
        allocation=allocation,
        **({"adaptive_alpha": 0.0} if allocation == "adaptive" else {}),
        window=2,
    )
    assert cache.evictions == 21


@pytest.mark.parametrize("allocation", ["calibrated", "adaptive"])
def test_a_token_policy_ranks_tokens_by_position_in_every_head(allocation, tmp_path):
    """random (one seeded draw per position) under an allocation: after every eviction the heads of every layer
    keep nested sets, each the top of one ranking, whichever head is widest: a token ranking follows
    positions, not slots (heads align their tokens each on its own)."""
    model = tiny_llama(layers=3)
    spec = CacheSpec.build("random", 12, 5, seed=11, **_settings(allocation, tmp_path, layers=3))
    key = cache_keyword(model)
    evictions, checked = 0, 0
    with reasonkv.EvictingCache(spec=spec, model=model) as cache:
        out = model(input_ids=torch.tensor([PROMPT]), use_cache=True, **{key: cache})
        for _ in range(40):
            if cache.evictions > evictions:
                evictions = cache.evictions
                sets = [set(h[h >= 0].tolist()) for layer in cache.full_layers for h in cache.positions(layer)[0]]
                sets.sort(key=len)
                for smaller, larger in zip(sets, sets[1:], strict=False):
                    assert smaller <= larger, (sorted(smaller), sorted(larger))
                    checked += 1
            out = model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **{key: cache})
    assert evictions >= 6 and checked >= 6 * 5


@pytest.mark.parametrize("allocation", ["adaptive", "pyramid"])
def test_batched_rows_evict_every_b_tokens_from_what_each_holds(allocation):
    """A row is due again B tokens after its own eviction, counted from what its heads hold, not from the batch's
    slots: under adaptive, rows whose widest heads keep different numbers held more than alone before."""
    model = tiny_llama(layers=4, kv_heads=4, heads=8)
    prompts = [PROMPT, PROMPT[3:20], PROMPT[7:]]
    traces = [[3 + (11 * i + 5 * r) % 90 for i in range(n)] for r, n in enumerate((70, 45, 60))]
    spec = CacheSpec.build("snapkv", 16, 6, window=3, query_window=3, allocation=allocation)
    together = trace_fidelity(model, prompts, traces, spec=spec)
    for r, row in enumerate(together):
        [alone] = trace_fidelity(model, prompts[r : r + 1], traces[r : r + 1], spec=spec)
        assert row.evictions == alone.evictions > 5, r
        assert row.step_bytes["held"] == pytest.approx(alone.step_bytes["held"], rel=1e-12), r
        assert row.top1_agreement == alone.top1_agreement, r


def test_pyramid_keeps_k_in_every_head_while_the_sequence_is_short_then_falls_with_depth():
    """PyramidKV's short-sequence branch: a row that has seen fewer than 2 (K - W) tokens keeps K everywhere
    (before, the upper layers asked for more than the row held, and the cache held less than uniform's); then
    the first layer keeps no more than it holds, and every eviction keeps the uniform total."""
    model = tiny_llama(layers=4)
    spec = CacheSpec.build("h2o", 20, 6, allocation="pyramid")  # W = 4 sinks: short below 2 x 16 = 32 tokens
    held = []

    def record(step, cache):
        seen = int(cache.next_position[0])
        counts = [(cache.positions(layer)[0] >= 0).sum(-1).tolist() for layer in cache.full_layers]
        held.append((seen, counts))

    reasonkv.generate(
        model, None, [PROMPT[:20]], spec=spec, max_new_tokens=40, chat=False, ignore_eos=True, on_step=record
    )
    after = [
        (seen, counts)
        for (seen, counts), (_, before) in zip(held[1:], held[:-1], strict=True)
        if counts != before and sum(map(sum, counts)) < sum(map(sum, before))
    ]  # just after each eviction
    short = [counts for seen, counts in after if seen < 32]
    long = [counts for seen, counts in after if seen >= 32]
    assert short and long
    assert all(c == [[20, 20]] * 4 for c in short)
    for counts in long:
        first, last = counts[0][0], counts[-1][0]
        assert first > 20 > last and sum(map(sum, counts)) == 20 * 4 * 2
