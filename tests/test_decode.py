"""Batched generation: batch == alone, full == model.generate, the model.generate(cache=...) path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reasonkv
from conftest import CharTokenizer, fast_few, tiny_llama, tiny_qwen3
from reasonkv.hf import cache_keyword
from reasonkv.inspect.page import departure as first_difference

PROMPTS = ["Let us think step by step about it.", "Why?", "Two plus three is five, so"]


@pytest.mark.parametrize("factory", fast_few([tiny_llama, tiny_qwen3], fast=(tiny_llama,)))
@pytest.mark.parametrize("policy", fast_few(["full", "streaming", "random"], fast=("random",)))
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


@pytest.mark.parametrize("policy", fast_few(["streaming", "random"], fast=("streaming",)))
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


def test_peak_kv_bytes_are_the_bytes_held_and_allocated_capacity_is_its_own_figure():
    model, tok = tiny_llama(), CharTokenizer()
    per_token = 3 * 2 * 2 * 16 * 4  # 3 layers x (K, V) x 2 kv heads x head_dim 16 x fp32
    [free] = reasonkv.generate(model, tok, "abc", max_new_tokens=40, ignore_eos=True)
    tok.eos_token_id = free.token_ids[4]
    [ended] = reasonkv.generate(model, tok, "abc", max_new_tokens=40)  # ends at token 5 of the 40 it made room for
    assert ended.finish_reason == "eos" and ended.num_tokens == 5
    held = (ended.prompt_tokens + ended.num_tokens - 1) * per_token  # the last token sampled is never fed
    assert ended.stats["peak_kv_bytes"] == held == ended.stats["peak_kv_bytes_by_tier"]["full"]
    assert ended.stats["peak_kv_bytes_allocated"] >= (ended.prompt_tokens + 39) * per_token > held


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policy="streaming", budget=0), "budget must be a positive integer"),
        (dict(policy="streaming", budget=8, buffer=-2), "buffer must be a non-negative integer, got -2"),
        (dict(policy="streaming"), "policy 'streaming' needs a budget"),
        (dict(policy="h2o2", budget=8), "unknown policy 'h2o2'; did you mean 'h2o'\\? valid policies:"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
        (dict(max_new_tokens=8.0), "max_new_tokens must be a positive integer, got 8.0"),
        (dict(max_new_tokens="8"), "max_new_tokens must be a positive integer, got '8'"),
        (dict(temperature=-1.0), "temperature must be a finite number >= 0 .*got -1.0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0 .*got nan"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0 .*got inf"),
        (dict(temperature="0.7"), "temperature must be a finite number >= 0 .*got '0.7'"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
        (dict(top_p=float("nan")), r"top_p must be a number in \(0, 1\], got nan"),
        (dict(top_p="0.9"), r"top_p must be a number in \(0, 1\], got '0.9'"),
        (dict(top_k=2.5), r"top_k must be a non-negative integer \(0 = off\), got 2.5"),
        (dict(top_k=True), "top_k must be a non-negative integer .*got True"),
        (dict(top_k=-1), "top_k must be a non-negative integer .*got -1"),
        (dict(seed=1.5), r"seed must be an integer or a list of 1 integers \(one per prompt\), got 1.5"),
        (dict(seed="7"), "seed must be an integer or a list of 1 integers .*got '7'"),
        (dict(seed=[1, 2]), "seed has 2 values for 1 prompts"),
        (dict(seed=[1.0]), r"seed must be an integer or a list of 1 integers .*got \[1.0\]"),
        (dict(stop=""), "stop strings must not be empty"),
        (dict(stop=["x", ""]), "stop strings must not be empty"),
        (dict(stop=[3]), r"stop must be a string or a list of strings, got \[3\]"),
        (dict(ignore_eos="False"), "ignore_eos must be True or False, got 'False'"),
        (dict(progress=1), "progress must be True or False, got 1"),
        (dict(on_step=5), "on_step must be a function"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, message, tokenizer):
    with pytest.raises(ValueError, match=message):
        reasonkv.generate(tiny_llama(), tokenizer, "hi", **kwargs)


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([], "prompts is empty: pass at least one prompt"),
        (None, "prompts must be a string, a list of strings or a list of token-id lists, got None"),
        ([[5, 6], []], r"prompts\[1\] is empty"),
        ([[5, 2.5]], r"prompts\[0\] must be a string or a list of integer token ids, got \[5, 2.5\]"),
        ([[5, True]], r"prompts\[0\] must be a string or a list of integer token ids"),
        ([[5, 96]], r"prompts\[0\] holds token id 96, outside the vocabulary \(the model's vocabulary is 0..95\)"),
        ([5, -1], r"prompts\[0\] holds token id -1, outside the vocabulary"),
        (["fine", [5, 500]], r"prompts\[1\] holds token id 500"),
    ],
)
def test_bad_prompts_are_clear_errors(prompts, message, tokenizer):
    with pytest.raises(ValueError, match=message):
        reasonkv.generate(tiny_llama(), tokenizer, prompts, max_new_tokens=2)


def test_token_ids_may_be_numpy_or_torch_integers(tokenizer):
    model = tiny_llama()
    [plain] = reasonkv.generate(model, tokenizer, [[5, 6, 7]], max_new_tokens=4)
    [from_tensor] = reasonkv.generate(model, tokenizer, torch.tensor([5, 6, 7]), max_new_tokens=4)
    [from_numpy] = reasonkv.generate(model, tokenizer, [np.array([5, 6, 7])], max_new_tokens=4)
    assert plain.token_ids == from_tensor.token_ids == from_numpy.token_ids


def test_one_stop_string_is_one_string_not_its_characters():
    model = tiny_llama()
    tok = CharTokenizer()
    [free] = reasonkv.generate(model, tok, "abc", max_new_tokens=15, ignore_eos=True)
    stop_text = tok.decode(free.token_ids[6:8])
    as_list = reasonkv.generate(model, tok, "abc", max_new_tokens=15, ignore_eos=True, stop=[stop_text])
    as_string = reasonkv.generate(model, tok, "abc", max_new_tokens=15, ignore_eos=True, stop=stop_text)
    assert as_string[0].token_ids == as_list[0].token_ids and as_string[0].finish_reason == "stop"
    # the output's first character followed by one it never writes: taken as characters, it would stop at once
    unseen = next(c for c in "~}|{`_^]" if c not in free.text)
    [never] = reasonkv.generate(model, tok, "abc", max_new_tokens=15, ignore_eos=True, stop=free.text[0] + unseen)
    assert never.finish_reason == "length" and never.token_ids == free.token_ids


def test_token_id_prompts_without_tokenizer():
    model = tiny_llama()
    [r] = reasonkv.generate(model, None, [[5, 6, 7, 8]], policy="streaming", budget=8, buffer=2, max_new_tokens=12)
    assert r.num_tokens == 12 and r.text == "" and r.stats["evictions"] > 0
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        reasonkv.generate(model, None, "hi")


def test_per_row_stats_count_only_while_the_row_is_live():
    """A row that hits EOS early stops counting: its stats equal the ones it gets alone."""
    model = tiny_llama()
    tok = CharTokenizer()
    kwargs = dict(policy="streaming", budget=6, buffer=3, max_new_tokens=40)
    free = reasonkv.generate(model, tok, PROMPTS, ignore_eos=True, **kwargs)
    # an EOS token that ends one row early, while another row decodes on for many steps
    row, eos = next(
        (i, r.token_ids[k]) for i, r in enumerate(free) for k in range(3, 15) if r.token_ids[k] not in r.token_ids[:k]
    )
    tok.eos_token_id = eos
    batched = reasonkv.generate(model, tok, PROMPTS, **kwargs)
    ended = batched[row]
    assert ended.finish_reason == "eos" and ended.num_tokens <= 15
    assert max(r.num_tokens for r in batched) >= ended.num_tokens + 9  # three more evictions' worth of steps
    for prompt, together in zip(PROMPTS, batched, strict=True):
        [alone] = reasonkv.generate(model, tok, [prompt], **kwargs)
        assert together.token_ids == alone.token_ids
        for key in ("evictions", "peak_row_tokens"):
            assert together.stats[key] == alone.stats[key], key
    longest = max(batched, key=lambda r: r.num_tokens)
    assert ended.stats["decode_seconds"] < longest.stats["decode_seconds"]
    assert ended.stats["tokens_per_second"] == (ended.num_tokens - 1) / ended.stats["decode_seconds"]


@pytest.mark.parametrize("policy, budget", [("full", None), ("streaming", 8), ("streaming", 40)])
def test_peak_row_tokens_is_what_the_cache_held(policy, budget, tokenizer):
    model = tiny_llama()
    held: list[int] = []  # real tokens after each forward, evictions done
    [r] = reasonkv.generate(
        model,
        tokenizer,
        PROMPTS[0],
        policy=policy,
        budget=budget,
        buffer=4,
        max_new_tokens=30,
        on_step=lambda step, cache: held.append(int(cache.row_lengths()[0])),
    )
    # prefill holds the prompt; each later forward holds what the previous one left plus its new token
    assert r.stats["peak_row_tokens"] == max([r.prompt_tokens] + [n + 1 for n in held[:-1]])


def _generate_with_logits(model, tokenizer, prompts, **kwargs):
    """``reasonkv.generate``, plus the last-position logits of every forward it runs."""
    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, out: logits.append(out.logits[:, -1].float().clone()))
    try:
        return reasonkv.generate(model, tokenizer, prompts, **kwargs), logits
    finally:
        hook.remove()


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("policy", fast_few(["full", "streaming", "h2o"], fast=("streaming",)))
def test_batch_equals_alone_up_to_rounding(dtype, policy, tokenizer):
    """What the README claims: a padded batch sums in another order than a lone row, so logits differ by
    rounding only (float32: about 1e-7; bf16: a few units in the last place), until the tokens part."""
    model = tiny_llama(dtype=dtype)
    kwargs = dict(policy=policy, budget=None if policy == "full" else 16, buffer=4, max_new_tokens=30)
    batched, batch_logits = _generate_with_logits(model, tokenizer, PROMPTS, **kwargs)
    for i, prompt in enumerate(PROMPTS):
        [alone], alone_logits = _generate_with_logits(model, tokenizer, [prompt], **kwargs)
        if dtype == torch.float32:
            assert batched[i].token_ids == alone.token_ids
        same = first_difference(batched[i].token_ids, alone.token_ids)
        steps = len(alone.token_ids) if same is None else same + 1  # the inputs agree up to there
        for step in range(steps):
            got, want = batch_logits[step][i], alone_logits[step][0]
            tolerance = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps * float(want.abs().max())
            assert float((got - want).abs().max()) <= tolerance, (prompt, step)
