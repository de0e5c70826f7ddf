"""Hybrid models: full-attention layers evict, sliding-window layers keep their model's window,
linear-attention layers keep their recurrent state; the oracle holds for every policy."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import reasonkv
from conftest import (
    HYBRID_MODELS,
    WINDOW,
    NoEosTokenizer,
    fast_few,
    tiny_gemma3,
    tiny_gpt_oss,
    tiny_mistral,
    tiny_qwen3_next,
)
from oracle import run_and_check
from reasonkv import EvictingCache
from reasonkv.cache.hybrid import check_layer_kinds
from reasonkv.hf import cache_keyword
from reasonkv.policies import Needs, Policy, policy_class

EVICTING = [name for name in reasonkv.list_policies() if policy_class(name).evicts]
PROMPT = [5 + (7 * i) % 80 for i in range(23)]
PROMPTS = ["A somewhat longer first prompt, to be padded against the others.", "Short.", "Middle length one."]
# Small enough to evict several times in a short run, large enough for every policy's protection.
SMALL = {"snapkv": dict(window=4, query_window=4), "vase-attnv": dict(window=4, query_window=4)}


@pytest.mark.parametrize("model_name", sorted(HYBRID_MODELS))
@pytest.mark.parametrize("policy", fast_few(EVICTING))
def test_oracle_on_hybrid_models(model_name, policy, one_torch_thread):
    model = HYBRID_MODELS[model_name]()
    prompt = PROMPT[:8] if policy_class(policy).protect_prompt else PROMPT  # a protected prompt must fit K
    cache = run_and_check(model, policy, prompt, budget=12, buffer=5, steps=24, seed=1, **SMALL.get(policy, {}))
    assert cache.evictions >= 3


@pytest.mark.parametrize("model_name", sorted(HYBRID_MODELS))
@pytest.mark.parametrize("policy", fast_few(EVICTING))
def test_hybrid_batch_equals_each_alone(model_name, policy, one_torch_thread):
    model, tokenizer = HYBRID_MODELS[model_name](), NoEosTokenizer()
    options = {"protect_prompt": False} if policy_class(policy).protect_prompt else {}  # prompts exceed K
    if policy_class(policy).options().get("window", 0) > 4:
        options["window"] = 4
    kw = dict(policy=policy, budget=16, buffer=4, max_new_tokens=20, seed=7, **options)
    together = reasonkv.generate(model, tokenizer, PROMPTS, **kw)
    assert max(r.stats["evictions"] for r in together) >= 2
    for prompt, result in zip(PROMPTS, together, strict=True):
        [alone] = reasonkv.generate(model, tokenizer, prompt, **kw)
        assert result.token_ids == alone.token_ids, (model_name, policy)


@pytest.mark.parametrize("model_name", sorted(HYBRID_MODELS))
def test_full_policy_equals_the_models_own_cache(model_name, tokenizer, one_torch_thread):
    """No eviction: sliding and linear layers under EvictingCache give what the model's own cache gives."""
    model = HYBRID_MODELS[model_name]()
    prompt = PROMPTS[0]
    [ours] = reasonkv.generate(model, tokenizer, prompt, max_new_tokens=25)
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    plain = model.generate(ids, max_new_tokens=25, do_sample=False, min_new_tokens=25)
    assert ours.token_ids == plain[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("model_name", sorted(HYBRID_MODELS))
def test_model_generate_with_a_hybrid_evicting_cache(model_name, tokenizer, one_torch_thread):
    model = HYBRID_MODELS[model_name]()
    [ours] = reasonkv.generate(model, tokenizer, PROMPTS[2], policy="tova", budget=10, buffer=4, max_new_tokens=24)
    ids = torch.tensor([tokenizer(PROMPTS[2])["input_ids"]])
    with EvictingCache(10, 4, model=model, policy="tova") as cache:
        kw = {cache_keyword(model): cache}
        out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, **kw)
    assert out[0, ids.shape[1] :].tolist() == ours.token_ids
    assert cache.evictions == ours.stats["evictions"] > 0


def test_each_layer_kind_keeps_its_own_storage(one_torch_thread):
    """Full layers stay within K + B, sliding layers hold their window, linear layers a fixed state."""
    budget, buffer = 10, 4
    for factory, kinds in ((tiny_gemma3, ("sliding", "full")), (tiny_qwen3_next, ("linear", "full"))):
        model = factory()
        with EvictingCache(budget, buffer, model=model, policy="streaming") as cache:
            out = model(input_ids=torch.tensor([PROMPT]), **{cache_keyword(model): cache})
            linear_bytes = cache.kv_bytes_by_kind()["linear"]
            for _ in range(15):
                token = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=token, **{cache_keyword(model): cache})
                by_kind = cache.kv_bytes_by_kind()
                assert cache.kv_bytes() == by_kind["full"] + by_kind["sliding"]
                assert by_kind["linear"] == linear_bytes  # recurrent state: constant size
        assert cache.full_layers == [1, 3]
        assert cache.slots <= budget + buffer and cache.evictions > 0
        newest = len(PROMPT) + 15 - 1
        for index, kind in enumerate(model.config.layer_types):
            layer = cache.layers[index]
            if kind == "sliding_attention":
                assert layer.keys.shape[2] == WINDOW - 1
                assert cache.positions(index)[0, 0].tolist() == list(range(newest - WINDOW + 2, newest + 1))
            elif kind == "linear_attention":
                assert cache.is_linear[index] and linear_bytes > 0
                with pytest.raises(ValueError, match=f"layer {index} .* holds no per-token positions"):
                    cache.positions(index)
        full_bytes = 2 * 2 * 2 * 16 * 4 * cache.layers[1].capacity  # layers x K/V x kv heads x dim x fp32
        assert cache.kv_bytes_by_kind()["full"] == full_bytes
        assert kinds[0] != "sliding" or cache.kv_bytes_by_kind()["sliding"] == 2 * 2 * 2 * 16 * 4 * (WINDOW - 1)


@dataclass
class _Rows(Policy):
    """Test-only: record the newest-query attention rows the observer recomputes."""

    name = "test-rows"
    granularity = "head"
    summary = "test"

    def needs(self, info):
        return Needs(attention_last=True)

    def reset(self, info, batch, device):
        self.rows = {}  # layer -> the newest query's attention row, [batch, query_heads, slots]

    def observe_attention(self, chunk):
        self.rows[chunk.layer] = chunk.rows[:, :, -1]

    def score(self, view):
        return torch.zeros(view.keys().shape[:3])


@pytest.mark.parametrize("factory", [tiny_gpt_oss, lambda: tiny_gemma3(softcap=2.0)], ids=["sinks", "softcap"])
def test_recomputed_attention_includes_sinks_and_softcap(factory, one_torch_thread):
    """The rows a policy reads equal the model's eager attention weights, sinks and soft-cap included."""
    model = factory()
    model.config._attn_implementation = "eager"
    ids = torch.tensor([PROMPT[:15]])
    with torch.no_grad():
        weights = model(input_ids=ids, output_attentions=True).attentions
        with EvictingCache(100, 4, model=model, policy=_Rows()) as cache:
            model(input_ids=ids, **{cache_keyword(model): cache})
    rows = cache.evictor.policy.rows  # handed over when the cache detached
    assert sorted(rows) == cache.full_layers == [1, 3]  # only the evicting layers' attention is recorded
    for layer, row in rows.items():
        want = weights[layer][:, :, -1]
        torch.testing.assert_close(row, want, atol=1e-5, rtol=0)
        assert bool((want.sum(-1) < 0.999).any()) == (factory is tiny_gpt_oss)  # the sinks took mass


def test_layer_kinds_the_cache_cannot_hold_are_refused_by_name(llama):
    with pytest.raises(ValueError, match=r"cannot hold \(chunked: layers \[1\]\); supported layer kinds"):
        check_layer_kinds(("full", "chunked", "full"), "M")
    llama.config.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has layers EvictingCache cannot hold \(chunked: layers"):
        EvictingCache(8, 4, model=llama, policy="streaming")
    llama.config.layer_types = ["full_attention", "full_attention", "mystery"]
    with pytest.raises(ValueError, match=r"layer 2 has type 'mystery', which reasonkv cannot cache"):
        EvictingCache(8, 4, model=llama, policy="streaming")


def test_all_sliding_model_is_refused_with_any_policy():
    for policy in ("full", "h2o"):
        with pytest.raises(ValueError, match=r"Mistral\w+ has no full-attention layer \(sliding: layers \[0, 1\]\)"):
            EvictingCache(None if policy == "full" else 8, 4, model=tiny_mistral(), policy=policy)


def test_epikv_counts_every_decoder_layer_on_a_hybrid_model(one_torch_thread):
    """EPIKV's layers index the residual stream of every layer: sliding layers 0 and 2 are valid a and b."""
    model = tiny_gemma3()
    cache = run_and_check(model, "epikv", PROMPT, budget=12, buffer=5, steps=12, a=0, b=2)
    assert cache.evictor.needs.hidden_layers == (0, 2) and cache.evictions >= 2


def test_attention_layer_options_must_name_full_attention_layers(one_torch_thread):
    with pytest.raises(ValueError, match=r"thinkv: layers: layers \[0\] are not full-attention layers; .*\[1, 3\]"):
        reasonkv.generate(tiny_gemma3(), NoEosTokenizer(), "a prompt", policy="thinkv", budget=16, layers=(0, 1))
