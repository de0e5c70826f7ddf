"""The contract every registered policy honours (one parametrized table over the registry)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import reasonkv
from conftest import TINY_MODELS, NoEosTokenizer, fast_few, tiny_llama
from oracle import run_and_check
from reasonkv.hf import cache_keyword
from reasonkv.policies import policy_class

POLICIES = reasonkv.list_policies()
EVICTING = [name for name in POLICIES if policy_class(name).evicts]
BUDGET, BUFFER = 48, 8
PROMPT = [5 + (11 * i) % 85 for i in range(37)]
PROMPTS = ["A somewhat longer first prompt, to be padded against the others.", "Short.", "Middle length one."]


def _guarded_sdpa(module, query, key, value, attention_mask, **kwargs):
    if kwargs.get("output_attentions"):
        raise AssertionError("a policy asked the model for attention weights")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("guarded_sdpa", _guarded_sdpa)
AttentionMaskInterface.register("guarded_sdpa", sdpa_mask)


@pytest.mark.parametrize("name", fast_few(EVICTING))
def test_oracle_budget_and_protection(name):
    model = tiny_llama()
    cache = run_and_check(model, name, PROMPT, budget=BUDGET, buffer=BUFFER, steps=40, seed=1)
    assert cache.evictions >= 3
    policy = cache.evictor.policy
    newest = len(PROMPT) + 40 - 1
    newest_at_eviction = newest - (cache.slots - BUDGET)  # tokens added since then are all held
    must_hold = set(range(policy.sinks)) | set(range(newest_at_eviction - policy.window + 1, newest + 1))
    for layer in range(model.config.num_hidden_layers):
        for head in cache.positions(layer)[0]:
            assert must_hold <= set(head.tolist()), f"{name} evicted a protected token"


@pytest.mark.parametrize(
    "sampling",
    [{}, pytest.param(dict(temperature=0.8, top_p=0.9, top_k=20), marks=pytest.mark.slow)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("name", fast_few(EVICTING, fast=("h2o",)))
def test_batch_of_different_lengths_equals_each_alone(name, sampling):
    """The README's claim, in fp32: a prompt gets bit-identical tokens and per-row stats in a batch."""
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    kw = dict(policy=name, budget=16, buffer=4, max_new_tokens=30, seed=[7, 8, 9], **sampling)
    kw.update(_small_options(name))
    together = reasonkv.generate(model, tokenizer, PROMPTS, **kw)
    for i, (prompt, result) in enumerate(zip(PROMPTS, together, strict=True)):
        [alone] = reasonkv.generate(model, tokenizer, prompt, **{**kw, "seed": kw["seed"][i]})
        assert result.token_ids == alone.token_ids, name
        assert result.stats["evictions"] == alone.stats["evictions"] > 0, name
        assert result.stats["peak_row_tokens"] == alone.stats["peak_row_tokens"], name


@pytest.mark.parametrize(("model_name", "bits"), [("llama-gqa", 4), ("llama-mha", 8)])
@pytest.mark.parametrize("name", fast_few(EVICTING, fast=("streaming",)))
def test_oracle_with_a_quantized_tier(name, model_name, bits):
    """Evicted positions masked, quantized ones seen with their dequantized K/V: the same logits."""
    model = TINY_MODELS[model_name]()
    options = dict(quantized=16, bits=bits, group_size=4, seed=1, **_small_options(name))
    cache = run_and_check(model, name, PROMPT, budget=24, buffer=6, steps=40, **options)
    assert cache.evictions >= 3 and cache.low_width == 16  # the quantized tier filled up


@pytest.mark.parametrize("name", fast_few(EVICTING, fast=("epikv",)))
def test_batch_with_a_quantized_tier_equals_each_alone(name):
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    kw = dict(policy=name, budget=12, buffer=4, quantized=8, bits=4, group_size=4, max_new_tokens=30, seed=7)
    kw.update(_small_options(name))
    together = reasonkv.generate(model, tokenizer, PROMPTS, **kw)
    for prompt, result in zip(PROMPTS, together, strict=True):
        [alone] = reasonkv.generate(model, tokenizer, prompt, **kw)
        assert result.token_ids == alone.token_ids, name


@pytest.mark.parametrize("name", fast_few(EVICTING, fast=("vase-attnv",)))
def test_seed_reproducibility(name):
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    kept = []
    for seed in (1, 1, 2):
        with reasonkv.EvictingCache(16, 4, model=model, policy=name, seed=seed, **_small_options(name)) as cache:
            ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
            model.generate(ids, max_new_tokens=12, do_sample=False, **{cache_keyword(model): cache})
            kept.append(torch.stack([cache.positions(layer) for layer in range(len(cache.layers))]))
    assert torch.equal(kept[0], kept[1])
    if policy_class(name).stochastic:
        assert not torch.equal(kept[0], kept[2]), f"{name} ignores its seed"


@pytest.mark.parametrize("name", fast_few(EVICTING, fast=("h2o",)))
def test_bf16_runs(name):
    model, tokenizer = tiny_llama(dtype=torch.bfloat16), NoEosTokenizer()
    [r] = reasonkv.generate(
        model,
        tokenizer,
        PROMPTS[0],
        policy=name,
        budget=16,
        buffer=4,
        max_new_tokens=20,
        **_small_options(name),
    )
    assert r.num_tokens == 20 and r.stats["evictions"] > 0


@pytest.mark.parametrize("name", fast_few(EVICTING))
def test_runs_under_a_kernel_that_refuses_attention_weights(name):
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    model.config._attn_implementation = "guarded_sdpa"
    [r] = reasonkv.generate(
        model,
        tokenizer,
        PROMPTS[0],
        policy=name,
        budget=16,
        buffer=4,
        max_new_tokens=20,
        **_small_options(name),
    )
    assert r.stats["evictions"] > 0
    assert model.config._attn_implementation == "guarded_sdpa"


@pytest.mark.parametrize("name", POLICIES)
def test_unknown_option_is_a_clear_error(name):
    listed = "" if policy_class(name).selects else ".*sinks"  # a selection policy protects nothing
    with pytest.raises(ValueError, match=f"policy '{name}' has no option 'not_an_option'; options: {listed}"):
        reasonkv.get_policy(name, not_an_option=1)


@pytest.mark.parametrize("name", POLICIES)
def test_policy_is_described(name):
    cls = policy_class(name)
    assert cls.summary and cls.granularity in ("token", "head")
    assert cls.__doc__ and ("sinks" in cls.options()) != cls.selects  # a selection policy protects nothing


def _small_options(name: str) -> dict:
    """Shrink observation windows so that a budget of 16 fits what a policy protects."""
    options = policy_class(name).options()
    small = {}
    if options.get("window", 0) > 4:
        small["window"] = 4
    if options.get("protect_prompt"):
        small["protect_prompt"] = False  # the longest prompt exceeds a budget of 16
    return small
