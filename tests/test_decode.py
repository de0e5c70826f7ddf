"""Batched generation: batch == alone, full == model.generate, the model.generate(cache=...) path."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import CharTokenizer, tiny_llama, tiny_qwen3
from reasonkv.hf import cache_keyword

PROMPTS = ["Let us think step by step about it.", "Why?", "Two plus three is five, so"]


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen3])
@pytest.mark.parametrize("policy", ["full", "streaming", "random"])
def test_batch_gives_each_prompt_the_tokens_it_gets_alone(factory, policy, tokenizer):
    model = factory()
    kwargs = dict(policy=policy, budget=None if policy == "full" else 12, buffer=5, max_new_tokens=30, seed=3)
    batched = reasonkv.generate(model, tokenizer, PROMPTS, **kwargs)
    for prompt, together in zip(PROMPTS, batched, strict=True):
        [alone] = reasonkv.generate(model, tokenizer, [prompt], **kwargs)
        assert together.token_ids == alone.token_ids
        assert together.stats["evictions"] == alone.stats["evictions"]
    if policy != "full":
        assert all(r.stats["evictions"] > 0 for r in batched)
        assert max(r.stats["peak_slots"] for r in batched) <= 12 + 5 or len(tokenizer(PROMPTS[0])["input_ids"]) > 17


def test_full_equals_plain_model_generate(tokenizer):
    model = tiny_llama()
    [ours] = reasonkv.generate(model, tokenizer, PROMPTS[0], max_new_tokens=25)
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    plain = model.generate(ids, max_new_tokens=25, do_sample=False)
    assert ours.token_ids == plain[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("policy", ["streaming", "random"])
def test_model_generate_with_evicting_cache_equals_reasonkv_generate(policy, tokenizer):
    model = tiny_llama()
    [ours] = reasonkv.generate(
        model, tokenizer, PROMPTS[0], policy=policy, budget=10, buffer=4, max_new_tokens=30, seed=5
    )
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    with reasonkv.EvictingCache(10, 4, model=model, policy=policy, seed=5) as cache:
        out = model.generate(ids, max_new_tokens=30, do_sample=False, **{cache_keyword(model): cache})
    assert out[0, ids.shape[1] :].tolist() == ours.token_ids
    assert cache.evictions == ours.stats["evictions"] > 0


def test_model_generate_batched_with_left_padding(tokenizer):
    model = tiny_llama()
    ours = reasonkv.generate(model, tokenizer, PROMPTS[:2], policy="streaming", budget=10, buffer=4, max_new_tokens=20)
    rows = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with reasonkv.EvictingCache(10, 4, model=model, policy="streaming") as cache:
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=20, do_sample=False, **{cache_keyword(model): cache}
        )
    assert [out[i, width:].tolist() for i in range(2)] == [r.token_ids for r in ours]


def test_sampling_is_seeded_per_row(tokenizer):
    model = tiny_llama()
    kw = dict(policy="random", budget=10, buffer=4, max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=20)
    a = reasonkv.generate(model, tokenizer, PROMPTS, seed=1, **kw)
    b = reasonkv.generate(model, tokenizer, PROMPTS, seed=1, **kw)
    c = reasonkv.generate(model, tokenizer, PROMPTS, seed=2, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    [alone] = reasonkv.generate(model, tokenizer, PROMPTS[1], seed=1, **kw)
    assert alone.token_ids == a[1].token_ids


def test_eos_and_stop_strings_end_a_row():
    model = tiny_llama()
    tok = CharTokenizer()
    [free] = reasonkv.generate(model, tok, "abc", max_new_tokens=15, ignore_eos=True)
    eos = free.token_ids[4]
    tok.eos_token_id = eos
    [ended] = reasonkv.generate(model, tok, "abc", max_new_tokens=15)
    assert ended.finish_reason == "eos" and ended.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    stop_text = tok.decode(free.token_ids[6:8])
    [stopped] = reasonkv.generate(model, tok, "abc", max_new_tokens=15, ignore_eos=True, stop=[stop_text])
    assert stopped.finish_reason == "stop" and stopped.text.endswith(stop_text)
    assert len(stopped.token_ids) <= 8


def test_result_stats(tokenizer):
    model = tiny_llama()
    [r] = reasonkv.generate(model, tokenizer, PROMPTS[0], policy="streaming", budget=10, buffer=4, max_new_tokens=12)
    assert r.num_tokens == 12 and r.finish_reason == "length"
    for key in (
        "evictions",
        "peak_slots",
        "prefill_seconds",
        "decode_seconds",
        "tokens_per_second",
        "peak_kv_bytes",
        "peak_memory_bytes",
        "batch_size",
    ):
        assert key in r.stats
    assert r.stats["peak_slots"] == len(tokenizer(PROMPTS[0])["input_ids"])  # prompt > K + B: evicted at once


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policy="streaming", budget=0), "budget must be a positive integer"),
        (dict(policy="streaming", budget=8, buffer=-2), "buffer must be a non-negative integer, got -2"),
        (dict(policy="streaming"), "policy 'streaming' needs a budget"),
        (dict(policy="h2o2", budget=8), "unknown policy 'h2o2'; valid policies:"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, message, tokenizer):
    with pytest.raises(ValueError, match=message):
        reasonkv.generate(tiny_llama(), tokenizer, "hi", **kwargs)


def test_token_id_prompts_without_tokenizer():
    model = tiny_llama()
    [r] = reasonkv.generate(model, None, [[5, 6, 7, 8]], policy="streaming", budget=8, buffer=2, max_new_tokens=12)
    assert r.num_tokens == 12 and r.text == "" and r.stats["evictions"] > 0
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        reasonkv.generate(model, None, "hi")
