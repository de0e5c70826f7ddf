"""CacheSpec: the cache's settings in one object, validated once, taken by every consumer."""

from __future__ import annotations

import importlib
import sys

import pytest

import reasonkv
from conftest import tiny_llama
from reasonkv.cache import DEFAULT_BUFFER, CacheSpec, EvictingCache
from reasonkv.cache.spec import resolve_spec
from reasonkv.eval.fidelity import trace_fidelity
from reasonkv.eval.grid import make_cells


def test_the_full_cache_ignores_the_budget_and_evicting_policies_need_one():
    assert CacheSpec("full", 128).budget is None
    assert CacheSpec.build("streaming", 64).budget == 64
    with pytest.raises(ValueError, match="policy 'h2o' needs a budget"):
        CacheSpec("h2o")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: CacheSpec("streaming", 0), "budget must be a positive integer"),
        (lambda: CacheSpec("streaming", 8, -1), "buffer must be a non-negative integer, got -1"),
        (lambda: CacheSpec("streaming", 8, True), "buffer must be a non-negative integer, got True"),
        (lambda: CacheSpec("nope", 8), "unknown policy 'nope'; valid policies:"),
        (lambda: CacheSpec.build("streaming", 8, sinks=6, window=4), r"sinks \(6\) \+ window \(4\) = 10 protected"),
        (lambda: CacheSpec("full", quantized=8), "'full' does not rank tokens, so it cannot fill a quantized tier"),
        (lambda: CacheSpec("streaming", 8, quantized=8, bits=3), "bits must be 4 or 8, got 3"),
        (lambda: CacheSpec("streaming", 8, bits=4), "bits=4 has no effect without a quantized tier"),
        (lambda: CacheSpec("streaming", 8, seed="7"), "seed must be an integer or a list of integers"),
        (lambda: CacheSpec.build("streaming", 8, nope=1), "policy 'streaming' has no option 'nope'"),
    ],
)
def test_bad_settings_are_refused_once_naming_the_value(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_protection_counts_the_quantized_tier():
    spec = CacheSpec.build("streaming", 8, quantized=4, sinks=6, window=6)
    assert spec.room == 12 and spec.bits == 8 and spec.trigger == 8 + DEFAULT_BUFFER
    with pytest.raises(ValueError, match=r"exceed the budget K \+ Q = 8 \+ 3 = 11"):
        CacheSpec.build("streaming", 8, quantized=3, sinks=6, window=6)


def test_a_spec_is_frozen_hashable_and_copies_its_policy_for_each_cache():
    spec = CacheSpec.build("h2o", 16, 4, seed=(1, 2))
    assert spec.seed == (1, 2) and hash(spec) == hash(CacheSpec.build("h2o", 16, 4, seed=[1, 2]))
    with pytest.raises(AttributeError):
        spec.budget = 8
    assert spec.new_policy() is not spec.policy and spec.new_policy() == spec.policy
    assert spec.replace(budget=32).budget == 32 and spec.budget == 16


def test_settings_come_from_the_spec_or_the_keywords_never_both():
    spec = CacheSpec.build("streaming", 16)
    assert resolve_spec(spec) is spec
    assert resolve_spec(None, policy="streaming", budget=16) == spec
    assert resolve_spec(None, quantized=0) == CacheSpec("full")  # 0 is "no tier", like not giving it
    with pytest.raises(ValueError, match="do not also pass budget, sinks"):
        resolve_spec(spec, budget=32, sinks=8)
    model = tiny_llama()
    with pytest.raises(ValueError, match="do not also pass policy"):
        reasonkv.generate(model, None, [[1, 2, 3]], spec, policy="h2o")
    with pytest.raises(ValueError, match="either as spec=... or as keywords"):
        EvictingCache(16, model=model, spec=spec)


def test_decoding_settings_go_beside_a_spec_and_a_cache_setting_given_twice_is_refused_by_name():
    model, prompt = tiny_llama(), [list(range(1, 30))]
    spec = CacheSpec.build("h2o", 12, 4, sinks=2)
    decoding = dict(temperature=0.6, top_p=0.9, top_k=40, max_new_tokens=30, ignore_eos=True)
    [by_spec] = reasonkv.generate(model, None, prompt, spec, seed=1, **decoding)
    [by_keywords] = reasonkv.generate(
        model, None, prompt, policy="h2o", budget=12, buffer=4, sinks=2, seed=1, **decoding
    )
    assert by_spec.token_ids == by_keywords.token_ids and len(by_spec.token_ids) == 30
    assert by_spec.stats["evictions"] > 2
    # The seed beside a spec is the sampling's: another seed samples other tokens, the spec's seed samples as it.
    [other] = reasonkv.generate(model, None, prompt, spec, seed=2, **decoding)
    [spec_seeded] = reasonkv.generate(model, None, prompt, spec.replace(seed=2), **decoding)
    assert other.token_ids != by_spec.token_ids and other.token_ids == spec_seeded.token_ids
    # ... and leaves the eviction's randomness to the spec: greedy, random eviction keeps what its spec seeds.
    random = CacheSpec.build("random", 8, 2, seed=5)
    greedy = [reasonkv.generate(model, None, prompt, random, seed=s, max_new_tokens=20)[0] for s in (None, 1, 2)]
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids
    [reseeded] = reasonkv.generate(model, None, prompt, random.replace(seed=1), max_new_tokens=20)
    assert reseeded.token_ids != greedy[0].token_ids  # (the eviction's seed does change them)
    for name, value in dict(policy="h2o", budget=32, buffer=8, quantized=16, bits=4, group_size=16, sinks=4).items():
        with pytest.raises(ValueError, match=f"do not also pass {name}$"):
            reasonkv.generate(model, None, prompt, spec, max_new_tokens=2, **{name: value})


def test_generate_the_cache_and_the_replays_take_a_spec_as_the_keywords_build_it():
    model = tiny_llama()
    prompt = [list(range(1, 30))]
    spec = CacheSpec.build("h2o", 12, 4, sinks=2)
    by_spec = reasonkv.generate(model, None, prompt, spec, max_new_tokens=40)[0]
    by_keywords = reasonkv.generate(model, None, prompt, policy="h2o", budget=12, buffer=4, sinks=2, max_new_tokens=40)[
        0
    ]
    assert by_spec.token_ids == by_keywords.token_ids and by_spec.stats["evictions"] > 5
    with EvictingCache(model=model, spec=spec) as cache:
        assert (cache.budget, cache.buffer) == (12, 4) and cache.evictor.policy.sinks == 2
    trace = by_spec.token_ids
    [a] = trace_fidelity(model, prompt, [trace], spec=spec.replace(seed=(3,)))
    [b] = trace_fidelity(model, prompt, [trace], policy="h2o", budget=12, buffer=4, sinks=2, seed=[3])
    assert a == b and a.evictions > 5


def test_the_grid_builds_one_full_cell_whatever_the_budgets():
    cells = make_cells("full,streaming", [16, 32], 4)
    assert [(c.policy, c.budget, c.buffer) for c in cells] == [
        ("full", None, None),
        ("streaming", 16, 4),
        ("streaming", 32, 4),
    ]


@pytest.mark.parametrize("old", ["select", "decode"])
def test_the_deprecated_alias_modules_are_gone(old):
    sys.modules.pop(f"reasonkv.{old}", None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"reasonkv.{old}")


def test_renamed_arguments_keep_working_with_a_deprecation_warning():
    model = tiny_llama()
    with pytest.warns(DeprecationWarning, match="seeds= is deprecated"):
        [row] = trace_fidelity(model, [[1, 2, 3, 4]], [[5, 6, 7]], policy="streaming", budget=4, buffer=1, seeds=[1])
    assert row.steps == 3


def test_a_generation_with_a_spec_seeds_every_row():
    model = tiny_llama()
    spec = CacheSpec.build("random", 8, 2, seed=(5, 6))
    rows = reasonkv.generate(model, None, [[1, 2, 3, 4], [7, 8, 9, 10]], spec, max_new_tokens=20)
    alone = reasonkv.generate(model, None, [[7, 8, 9, 10]], spec.replace(seed=6), max_new_tokens=20)
    assert rows[1].token_ids == alone[0].token_ids
    with pytest.raises(ValueError, match="seed has 2 values for 1 prompts"):
        reasonkv.generate(model, None, [[1, 2, 3]], spec, max_new_tokens=2)
