"""The quantized tier: the three-way split, the packed storage, the cache's bookkeeping, bad input.

The logits are checked by the oracle (``tests/oracle.py``) for every policy in
``test_policy_contract.py``; here: what goes where, what is stored, what is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from oracle import run_and_check
from reasonkv.cache import EvictingCache
from reasonkv.cache.quantize import QuantFormat
from reasonkv.cache.tiers import (
    budget_for_bytes,
    equivalent_budget,
    full_token_bytes,
    quantized_token_bytes,
    split_tiers,
)
from reasonkv.hf import cache_keyword
from reasonkv.policies import Policy, policy_class, select

MUST, NEVER = select.MUST_KEEP, select.NEVER_KEEP
PROMPT = [5 + (7 * i) % 80 for i in range(23)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------- the split


def test_split_takes_full_precision_first_then_quantized_then_drops():
    priority = torch.tensor([[5.0, 1.0, MUST, 9.0, 8.0, 2.0, 7.0, NEVER]])
    held = torch.tensor([True, True, False, False, False, False, False, False])  # slots 0, 1 already quantized
    split = split_tiers(priority, held, full=3, quantized=3)
    assert split.full.tolist() == [[2, 3, 4]]  # the protected slot, then 9 and 8
    # Slot 0 (5, quantized) outranks slot 5 (2) and stays; 6 (7) is quantized now; 1 (1) is dropped.
    assert split.quantized.tolist() == [[0, 5, 6]] and split.counts.tolist() == [3]


def test_a_quantized_token_is_never_promoted_whatever_its_rank():
    priority = torch.tensor([[100.0, 1.0, 2.0, 3.0]])
    split = split_tiers(priority, torch.tensor([True, False, False, False]), full=2, quantized=1)
    assert split.full.tolist() == [[2, 3]] and split.quantized.tolist() == [[0]]


def test_protected_tokens_beyond_k_are_kept_quantized_newest_at_full_precision():
    priority = torch.tensor([[1.0, 2.0, MUST, MUST, MUST, 3.0]])
    split = split_tiers(priority, torch.zeros(6, dtype=torch.bool), full=1, quantized=2)
    assert split.full.tolist() == [[4]] and split.quantized.tolist() == [[2, 3]]
    with pytest.raises(ValueError, match=r"3 protected tokens exceed the budget K \+ Q = 1 \+ 1"):
        split_tiers(priority, torch.zeros(6, dtype=torch.bool), full=1, quantized=1)


def test_rows_with_fewer_tokens_quantize_fewer_and_pad_on_the_left():
    priority = torch.tensor([[4.0, 3.0, 2.0, 1.0], [NEVER, NEVER, 2.0, 1.0]])
    split = split_tiers(priority, torch.zeros(4, dtype=torch.bool), full=1, quantized=3)
    assert split.full.tolist() == [[0], [2]]
    assert split.quantized.tolist() == [[1, 2, 3], [-1, -1, 3]] and split.counts.tolist() == [3, 1]


def test_ties_break_as_the_policy_alone_breaks_them_the_full_tier_is_its_keep_at_k():
    # Scores of few distinct values, so most of every ranking is ties; protected and padding slots too.
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (4, 3, 60), generator=generator).float()
    valid = torch.ones(4, 1, 60, dtype=torch.bool)
    valid[1, :, :9] = False
    protected = torch.zeros(4, 1, 60, dtype=torch.bool)
    protected[..., 9:13] = True
    ranking = select.rank_top(scores, valid=valid, protected=protected)
    for full, quantized in ((8, 20), (16, 16), (30, 21)):
        split = split_tiers(ranking, torch.zeros(60, dtype=torch.bool), full=full, quantized=quantized)
        assert torch.equal(split.full, select.keep_ranked(ranking, k=full))
        both = torch.cat([split.full, split.quantized], -1).sort(-1).values
        assert torch.equal(both, select.keep_ranked(ranking, k=full + quantized))


def test_too_few_full_precision_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot keep 3 full-precision tokens from a row holding only 2"):
        split_tiers(torch.ones(1, 4), torch.tensor([True, True, False, False]), full=3, quantized=1)


def test_sampled_tiers_are_one_draw_the_full_tier_what_the_policy_alone_keeps_at_k():
    torch.manual_seed(0)
    weights = torch.rand(3, 2, 40)
    valid = torch.ones(3, 1, 40, dtype=torch.bool)
    protected = torch.zeros(3, 1, 40, dtype=torch.bool)
    protected[..., :4] = True

    keyed = dict(seeds=torch.arange(11, 14), positions=torch.arange(40))  # each row's draws, keyed

    ranking = select.rank_sampled(weights, valid=valid, protected=protected, **keyed)
    split = split_tiers(ranking, torch.zeros(40, dtype=torch.bool), full=10, quantized=8)
    alone_k = select.keep_sampled(weights, valid=valid, protected=protected, k=10, **keyed)
    alone_kq = select.keep_sampled(weights, valid=valid, protected=protected, k=18, **keyed)
    assert torch.equal(split.full, alone_k)
    assert torch.equal(torch.cat([split.full, split.quantized], -1).sort(-1).values, alone_kq)


# ---------------------------------------------------------------------------------- the storage


def test_nominal_bytes_per_token_and_equal_byte_budgets():
    fmt8, fmt4 = QuantFormat(8, 32), QuantFormat(4, 32)
    assert full_token_bytes(64, 2) == 256
    # codes 2 * 64 * bits / 8, values' statistics 2 * 2 groups * 2 bytes, keys' 2 * 64 * 2 / 32, the group id 2
    assert quantized_token_bytes(64, 2, fmt8) == 128 + 8 + 8 + 2
    assert quantized_token_bytes(64, 2, fmt4) == 64 + 8 + 8 + 2
    assert equivalent_budget(64, 112, fmt8, 64, 2) == pytest.approx(64 + 112 * 146 / 256)
    assert budget_for_bytes(128, 112, fmt8, 64, 2) == 128 - 64  # 112 * 146 / 256 = 63.9 -> 64


# ---------------------------------------------------------------------------------- in the cache


def _decode(model, cache, steps: int, on_step=None) -> None:
    key = cache_keyword(model)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([PROMPT]), use_cache=True, **{key: cache})
        for step in range(steps):
            if on_step is not None:
                on_step(step)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=token, use_cache=True, **{key: cache})


def test_the_tiers_hold_k_full_and_up_to_q_quantized_and_quantized_tokens_never_return():
    model = tiny_llama()
    cache = EvictingCache(10, 4, model=model, policy="random", quantized=6, bits=4, group_size=2)
    seen_quantized: set[tuple[int, int, int]] = set()

    def check(step):
        if not cache.evictions:
            return
        for layer in range(len(cache.layers)):
            positions = cache.positions(layer)[0]
            low, full = positions[:, : cache.low_width], positions[:, cache.low_width :]
            assert low.shape[1] <= 6 and full.shape[1] <= 10 + 4
            for head in range(positions.shape[0]):
                seen_quantized.update((layer, head, int(p)) for p in low[head])
                assert not {(layer, head, int(p)) for p in full[head]} & seen_quantized, "a token was promoted"

    _decode(model, cache, 40, check)
    cache.detach()
    assert cache.evictions >= 5 and cache.low_width == 6
    assert len(seen_quantized) > 6 * len(cache.layers) * 2  # tokens left the quantized tier too


def test_bytes_are_reported_per_tier_and_int4_holds_fewer_than_int8():
    model = tiny_llama()
    held = {}
    for bits in (8, 4):
        cache = EvictingCache(10, 4, model=model, policy="streaming", quantized=8, bits=bits, group_size=4)
        _decode(model, cache, 30)
        cache.detach()
        held[bits] = cache.kv_bytes_by_tier()
        layer = cache.layers[0]
        per_token = 2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size() * len(cache.layers)
        assert held[bits]["full"] == (10 + 4) * per_token  # capacity K + B, released after the prompt
        assert cache.kv_bytes() == held[bits]["full"] + held[bits]["quantized"]
    assert 0 < held[4]["quantized"] < held[8]["quantized"]
    layers, heads, tokens, dim = 3, 2, 8, 16
    assert (
        held[8]["quantized"] - held[4]["quantized"] == layers * heads * tokens * dim
    )  # codes: d/2 bytes less, K and V


def test_protected_tokens_beyond_k_stay_held_quantized_and_match_the_oracle():
    model = tiny_llama()
    tier = dict(quantized=6, bits=8, group_size=2)
    cache = run_and_check(model, "streaming", PROMPT, budget=8, buffer=3, steps=25, window=10, **tier)
    newest = len(PROMPT) + 25 - 1
    newest_at_eviction = newest - (cache.slots - cache.low_width - 8)
    for layer in range(len(cache.layers)):
        for head in cache.positions(layer)[0]:
            assert set(range(newest_at_eviction - 10 + 1, newest + 1)) <= set(head.tolist())


def test_model_generate_and_reasonkv_generate_take_the_tier():
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    with EvictingCache(12, 4, model=model, policy="snapkv", window=4, quantized=8, bits=4, group_size=4) as cache:
        ids = torch.tensor([tokenizer("Hello, a longer prompt of many characters")["input_ids"]])
        model.generate(ids, max_new_tokens=20, do_sample=False, **{cache_keyword(model): cache})
    assert cache.evictions > 0 and cache.low_width == 8
    [result] = reasonkv.generate(
        model, tokenizer, "Hello, a longer prompt", policy="snapkv", budget=12, buffer=4, quantized=8, bits=4,
        group_size=4, max_new_tokens=30, window=4,
    )  # fmt: skip
    stats = result.stats
    assert stats["quantized"] == 8 and stats["bits"] == 4 and stats["peak_kv_bytes_by_tier"]["quantized"] > 0
    assert stats["peak_kv_bytes"] == sum(stats["peak_kv_bytes_by_tier"].values())


# ---------------------------------------------------------------------------------- VASE's reservation


class _View:
    """Just enough of an EvictionView for the VASE selection: one layer, one row, one head."""

    def __init__(self, values: torch.Tensor, quantized: torch.Tensor, budget: int):
        self._values, self._quantized, self.budget = values, quantized, budget
        self.seeds = torch.zeros(1, dtype=torch.int64)

    def positions(self):
        return torch.arange(self._values.shape[2]).view(1, 1, -1)

    def valid_mask(self):
        return torch.ones(1, 1, self._values.shape[2], dtype=torch.bool)

    def protected(self):
        return torch.zeros(1, 1, self._values.shape[2], dtype=torch.bool)

    def quantized_mask(self):
        return self._quantized.view(1, 1, -1)

    def values(self):
        return self._values


def test_vase_reserves_by_value_range_among_full_precision_tokens_only():
    from reasonkv.policies.vase import value_aware_rank

    values = torch.zeros(1, 1, 10, 4)
    values[0, 0, :, 0] = torch.arange(10.0)  # value range grows with the slot
    quantized = torch.zeros(10, dtype=torch.bool)
    quantized[8:] = True  # the two widest are quantized: they cannot be reserved
    policy = reasonkv.get_policy("vase-attnv", reserve=2, sample=False)
    ranking = value_aware_rank(policy, _View(values, quantized, budget=4), torch.ones(1, 1, 10))
    assert (ranking[0, 0] >= MUST).nonzero().flatten().tolist() == [6, 7]


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(quantized=-1), "quantized must be a non-negative integer .*got -1"),
        (dict(quantized=2.5), "quantized must be a non-negative integer .*got 2.5"),
        (dict(quantized=4, bits=3), "bits must be 4 or 8, got 3"),
        (dict(bits=4), "bits=4 has no effect without a quantized tier"),
        (dict(group_size=8), "group_size=8 has no effect without a quantized tier"),
        (dict(quantized=4, group_size=5), "group_size 5 does not divide head_dim 16; allowed: 1, 2, 4, 8, 16"),
        (dict(quantized=8), r"quantized=8 holds fewer tokens than one key group \(16 tokens, head_dim 16\)"),
    ],
)
def test_bad_tier_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EvictingCache(16, 4, model=tiny_llama(), policy="streaming", **kwargs)


def test_a_tier_needs_a_policy_that_ranks_tokens_and_room_for_the_protected_ones():
    model = tiny_llama()
    with pytest.raises(ValueError, match="policy 'full' does not rank tokens, so it cannot fill a quantized tier"):
        EvictingCache(None, 4, model=model, policy="full", quantized=8)
    with pytest.raises(ValueError, match="quantized=8\\) needs a budget"):
        EvictingCache(None, 4, quantized=8)
    with pytest.raises(ValueError, match=r"36 protected tokens exceed the budget K \+ Q = 16 \+ 8 = 24"):
        EvictingCache(16, 4, model=model, policy="snapkv", quantized=8)  # window 32 + 4 sinks
    EvictingCache(16, 4, model=model, policy="snapkv", quantized=20).detach()  # 36 <= 16 + 20: fits


@dataclass
class _KeepOnly(Policy):
    """Test-only: chooses its indices itself, so it has no ranking to split."""

    name = "test-keep-only"
    granularity = "token"
    summary = "test"

    def score(self, view):
        return torch.zeros_like(view.valid, dtype=torch.float32)

    def keep(self, view):
        return select.keep_top(self.score(view), valid=view.valid, protected=view.protected(), k=view.budget)


def test_a_policy_that_only_overrides_keep_cannot_fill_a_tier():
    assert not _KeepOnly.can_rank()
    assert all(policy_class(name).can_rank() for name in reasonkv.list_policies() if policy_class(name).evicts)
    with pytest.raises(ValueError, match="'test-keep-only' does not rank tokens"):
        EvictingCache(16, 4, model=tiny_llama(), policy=_KeepOnly(), quantized=8)
    EvictingCache(16, 4, model=tiny_llama(), policy=_KeepOnly()).detach()  # without a tier it still evicts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_keep_their_statistics_in_their_dtype(dtype):
    model, tokenizer = tiny_llama(dtype=dtype), NoEosTokenizer()
    with EvictingCache(12, 4, model=model, policy="vase-dkv", quantized=8, bits=4, group_size=4) as cache:
        ids = torch.tensor([tokenizer("A prompt that is long enough to be evicted at once")["input_ids"]])
        model.generate(ids, max_new_tokens=16, do_sample=False, **{cache_keyword(model): cache})
    tier = cache.layers[0].quantized
    assert tier.key_stats.dtype == tier.value_stats.dtype == dtype
    keys, values = cache.attended(0)
    assert keys.dtype == values.dtype == dtype and bool(torch.isfinite(keys).all() and torch.isfinite(values).all())
