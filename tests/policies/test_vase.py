"""VASE: value-range reservation, seeded sampling without replacement, ablation switches."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import reasonkv
from conftest import fast_few, tiny_llama
from reasonkv.hf import cache_keyword
from reasonkv.models import SMOLLM2_INSTALL_COMMAND, SMOLLM2_PACKAGE
from reasonkv.policies import select
from reasonkv.policies.contract import ModelInfo
from reasonkv.policies.vase import reserve_count

# --------------------------------------------------------------------------- a view over synthetic tensors


class FakeView:
    """The parts of an EvictionView that VASE-AttnV reads, over given tensors (one layer).

    ``weights`` ``[rows, heads, slots]`` come back as the window attention of one query per head, so
    with ``kernel=1`` the policy's base score is exactly ``weights``. Padding sits at the left.
    """

    def __init__(self, policy, weights, *, values=None, seeds, budget, padding=None):
        rows, heads, slots = weights.shape
        self.policy, self.budget, self.layer = policy, budget, 0
        self.rows = torch.arange(rows)
        self.seeds = torch.tensor(list(seeds), dtype=torch.int64)
        self.info = ModelInfo(num_layers=1, num_heads=heads, num_kv_heads=heads, head_dim=4)
        self.valid = torch.ones(rows, slots, dtype=torch.bool)
        for row, n in enumerate(padding or []):
            self.valid[row, :n] = False
        real = self.valid.long().cumsum(-1) - 1
        self._positions = real.masked_fill(~self.valid, -1).unsqueeze(1).expand(rows, heads, slots)
        self._weights = weights
        self._values = values if values is not None else torch.zeros(rows, heads, slots, 4)

    def valid_mask(self):
        return self.valid.unsqueeze(1)

    def positions(self):
        return self._positions

    @property
    def newest(self):
        return self._positions.amax(dim=(1, 2))

    def protected(self):
        p = self.policy
        return select.protected_mask(self._positions, sinks=p.sinks, window=p.window, newest=self.newest)

    def values(self):
        return self._values

    def quantized_mask(self):
        return torch.zeros_like(self.valid_mask())  # no quantized tier

    def keys(self):
        return self._values

    def window_attention(self):
        return self._weights.unsqueeze(2)  # [rows, heads, w=1, slots]


def _attnv(**options):
    base = dict(sinks=0, window=0, kernel=1, reserve=0)
    base.update(options)
    return reasonkv.get_policy("vase-attnv", **base)


# --------------------------------------------------------------------------- sampling


def test_sampled_sets_have_exact_size_no_duplicates_and_follow_the_seed():
    policy = _attnv()
    weights = torch.rand(3, 2, 30) + 0.01
    kept = policy.keep(FakeView(policy, weights, seeds=[1, 2, 3], budget=9))
    assert kept.shape == (3, 2, 9)
    assert all(len(set(head.tolist())) == 9 for row in kept for head in row)
    assert torch.equal(kept, kept.sort(-1).values)
    again = policy.keep(FakeView(policy, weights, seeds=[1, 2, 3], budget=9))
    other = policy.keep(FakeView(policy, weights, seeds=[4, 5, 6], budget=9))
    assert torch.equal(kept, again) and not torch.equal(kept, other)


def test_inclusion_frequency_increases_with_weight():
    policy = _attnv()
    classes = torch.tensor([1.0, 2.0, 4.0, 8.0])
    weights = classes.repeat_interleave(10).view(1, 1, 40)
    seeds = list(range(400))
    kept = policy.keep(FakeView(policy, weights.expand(400, 1, 40), seeds=seeds, budget=10))
    counts = torch.zeros(40)
    counts.scatter_add_(0, kept.flatten(), torch.ones(kept.numel()))
    frequency = (counts / 400).view(4, 10).mean(1)
    assert torch.all(frequency[1:] - frequency[:-1] > 0.05), frequency
    assert abs(float(frequency.sum()) * 10 - 10) < 1e-4  # exactly 10 kept per draw


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_a_single_draw_follows_the_tempered_weights(temperature):
    policy = _attnv(temperature=temperature)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rows = 4000
    kept = policy.keep(FakeView(policy, weights.view(1, 1, 4).expand(rows, 1, 4), seeds=range(rows), budget=1))
    frequency = torch.bincount(kept.flatten(), minlength=4).float() / rows
    tempered = weights ** (1 / temperature)
    torch.testing.assert_close(frequency, tempered / tempered.sum(), atol=0.03, rtol=0)


def test_a_padded_row_samples_as_it_does_alone():
    policy = _attnv()
    real = torch.rand(1, 2, 20) + 0.01
    padded = torch.cat([torch.rand(1, 2, 6), real], dim=-1)
    alone = policy.keep(FakeView(policy, real, seeds=[9], budget=7))
    batch_weights = torch.cat([padded, torch.rand(1, 2, 26)])
    together = policy.keep(FakeView(policy, batch_weights, seeds=[9, 3], budget=7, padding=[6, 0]))
    assert torch.equal(together[0] - 6, alone[0])


def test_sample_false_is_top_k_and_ignores_the_seed():
    policy = _attnv(sample=False)
    weights = torch.rand(1, 2, 25)
    a = policy.keep(FakeView(policy, weights, seeds=[1], budget=6))
    b = policy.keep(FakeView(policy, weights, seeds=[2], budget=6))
    assert torch.equal(a, b)
    assert torch.equal(a, weights.topk(6, dim=-1).indices.sort(-1).values)


# --------------------------------------------------------------------------- reservation


def test_reservation_keeps_the_largest_value_ranges_whatever_their_weight():
    policy = _attnv(reserve=3, sample=False)
    values = torch.randn(1, 2, 24, 4) * 0.1
    big = {0: [2, 5, 11], 1: [0, 7, 20]}
    for head, slots in big.items():
        for slot in slots:
            values[0, head, slot] = torch.tensor([10.0, -10.0, 0.0, 0.0])
    weights = torch.rand(1, 2, 24) + 1.0
    for head, slots in big.items():
        weights[0, head, slots] = 1e-6  # the base score alone would evict them
    kept = policy.keep(FakeView(policy, weights, values=values, seeds=[0], budget=8))
    for head, slots in big.items():
        assert set(slots) <= set(kept[0, head].tolist())
    no_reserve = _attnv(reserve=0, sample=False)
    kept = no_reserve.keep(FakeView(no_reserve, weights, values=values, seeds=[0], budget=8))
    assert not set(big[0]) & set(kept[0, 0].tolist())


def test_reserve_top_skips_protected_and_padding_and_leaves_room_for_protection():
    scores = torch.tensor([[5.0, 9.0, 8.0, 7.0, 6.0, float("nan"), 1.0]])
    valid = torch.tensor([[False, True, True, True, True, True, True]])
    protected = torch.tensor([[False, True, False, False, False, False, False]])
    mask = select.reserve_top(scores, valid=valid, protected=protected, n=2, k=5)
    assert mask.tolist() == [[False, False, True, True, False, False, False]]
    capped = select.reserve_top(scores, valid=valid, protected=protected, n=4, k=3)
    assert capped.sum().item() == 2  # 1 protected + 2 reserved = k
    assert not select.reserve_top(scores, valid=valid, protected=protected, n=0, k=5).any()


def test_reserve_count_fraction_or_count():
    assert reserve_count(0.125, 64) == 8 and reserve_count(0.125, 100) == 100 // 8
    assert reserve_count(0, 64) == 0 and reserve_count(0.0, 64) == 0
    assert reserve_count(5, 64) == 5 and reserve_count(5.0, 64) == 5
    assert reasonkv.get_policy("vase-attnv").reserve == 0.125


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(reserve=-1), "reserve must be a token count"),
        (dict(reserve=2.5), "reserve must be a token count"),
        (dict(reserve=True), "option reserve=True: expected float"),
        (dict(temperature=0), "temperature must be a positive number"),
        (dict(temperature=float("nan")), "temperature must be a positive number"),
        (dict(sample="yes"), "option sample='yes': expected bool"),
    ],
)
def test_bad_selection_options_are_clear_errors(options, match):
    for name in ("vase-attnv", "vase-dkv"):
        with pytest.raises(ValueError, match=f"{name}: {match}"):
            reasonkv.get_policy(name, **options)


def test_cli_ablation_options_parse():
    from reasonkv.policies import parse_options

    for name in ("vase-attnv", "vase-dkv"):
        options = parse_options(name, ["sample=false", "reserve=0"])
        policy = reasonkv.get_policy(name, **options)
        assert policy.sample is False and reserve_count(policy.reserve, 64) == 0


# --------------------------------------------------------------------------- planted values in a real cache

BUDGET, BUFFER = 64, 16
PROMPT = [5 + (7 * i) % 80 for i in range(70)]


def _run_with_planted_values(name: str, seed: int, **options) -> tuple[int, int]:
    """Plant N_v large-range value vectors per (layer, head) at the first eviction; count how often a
    planted token is missing from a kept set over the run. Returns (checks, evicted)."""
    model = tiny_llama()
    planted: dict[int, list[list[int]]] = {}  # layer -> per head, planted logical positions
    tally = {"checks": 0, "evicted": 0}
    with reasonkv.EvictingCache(BUDGET, BUFFER, model=model, policy=name, seed=seed, **options) as cache:
        policy = cache.evictor.policy
        original = policy.keep

        def keep(view):
            layer, values = view.layer, view.cache.layers[view.layer].values  # the stored tensor itself
            positions = view.positions()[0]
            if layer not in planted:
                planted[layer] = []
                for head in range(positions.shape[0]):
                    chosen = [8 + head + 4 * j for j in range(BUDGET // 8)]  # unprotected positions
                    planted[layer].append(chosen)
                    for p in chosen:
                        slot = int((positions[head] == p).nonzero())
                        values[0, head, slot] = 0.0
                        values[0, head, slot, 0], values[0, head, slot, 1] = 30.0, -30.0
            kept = original(view)
            for head, chosen in enumerate(planted[layer]):
                held = set(positions[head][kept[0, head]].tolist())
                tally["checks"] += len(chosen)
                tally["evicted"] += sum(p not in held for p in chosen)
            return kept

        policy.keep = keep
        ids = torch.tensor([PROMPT])
        model.generate(ids, max_new_tokens=44, do_sample=False, **{cache_keyword(model): cache})
        assert cache.evictions >= 3
    return tally["checks"], tally["evicted"]


@pytest.mark.parametrize("name", fast_few(["vase-attnv", "vase-dkv"], fast=("vase-dkv",)))
@pytest.mark.parametrize("sample", [pytest.param(True, marks=pytest.mark.slow), False])
def test_planted_large_values_survive_every_eviction_under_every_seed(name, sample):
    for seed in (0, 1, 2):
        checks, evicted = _run_with_planted_values(name, seed, sample=sample)
        assert checks > 0 and evicted == 0, f"{name} seed {seed}: {evicted} planted tokens evicted"


@pytest.mark.parametrize("name", fast_few(["vase-attnv", "vase-dkv"], fast=("vase-dkv",)))
@pytest.mark.parametrize("sample", [pytest.param(True, marks=pytest.mark.slow), False])
def test_without_reservation_planted_values_can_be_evicted(name, sample):
    evicted = sum(_run_with_planted_values(name, seed, sample=sample, reserve=0)[1] for seed in (0, 1))
    assert evicted > 0


# --------------------------------------------------------------------------- the bundled model


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec(SMOLLM2_PACKAGE) is None, reason=f"needs `{SMOLLM2_INSTALL_COMMAND}`")
@pytest.mark.slow
def test_vase_policies_decode_with_the_bundled_model():
    from reasonkv.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    prompt = "Explain step by step why the sum of two even numbers is always even."
    for name in ("vase-attnv", "vase-dkv"):
        [result] = reasonkv.generate(
            model, tokenizer, prompt, policy=name, budget=64, buffer=16, max_new_tokens=80, ignore_eos=True, seed=1
        )
        assert result.num_tokens == 80 and result.stats["evictions"] > 0, name
        assert result.text.strip(), name
