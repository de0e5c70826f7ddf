"""RaaS: timestamps equal a reference loop over independently computed attention rows."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import reasonkv
from attention_reference import drive, eager_attentions, masked_attentions
from conftest import TINY_MODELS, fast_few, tiny_llama
from reasonkv.hf import cache_keyword

PROMPT = [6 + (19 * i) % 81 for i in range(10)]
TOKENS = [8 + (37 * i) % 79 for i in range(32)]
THRESHOLD = 0.03  # the tiny model spreads ~1/40 per token: some tokens pass, many do not


# ---------------------------------------------------------------------------------------- helpers
_drive = partial(drive, policy="raas", snapshot=lambda cache: cache.evictor.policy.timestamps.data[0])


def _reference_timestamps(probs, prompt_len, kv_heads, threshold, reduce="max"):
    """The RaaS rule as a plain loop over attention rows.

    A token starts with its own position as timestamp; after each forward pass (the prefill's last
    prompt query, then every decoded token) the tokens whose attention from that newest query,
    combined over the query heads of the kv group, exceeds ``threshold`` get the query's position.
    Returns the timestamps after every forward ``[forwards, layers, kv_heads, T]`` and the smallest
    distance of any combined attention value from the threshold (to be sure the test is not
    decided by rounding).
    """
    total = probs[0].shape[-1]
    stamps = torch.full((len(probs), kv_heads, total), -1.0, dtype=torch.float64)
    history, margin = [], float("inf")
    for t in range(prompt_len - 1, total):
        first = 0 if t == prompt_len - 1 else t  # tokens arriving with this forward
        stamps[:, :, first : t + 1] = torch.arange(first, t + 1, dtype=torch.float64)
        for layer, p in enumerate(probs):
            row = p[:, t, : t + 1]  # [query_heads, t + 1]
            grouped = row.reshape(kv_heads, -1, t + 1)
            combined = grouped.amax(1) if reduce == "max" else grouped.mean(1)
            seen = combined[combined > 0]
            if seen.numel():
                margin = min(margin, float((seen - threshold).abs().min()))
            stamps[layer, :, : t + 1] = torch.where(combined > threshold, float(t), stamps[layer, :, : t + 1])
        history.append(stamps.clone())
    return torch.stack(history), margin


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("model_name", fast_few(["llama-gqa", "llama-mha", "qwen3-gqa"], fast=("llama-gqa",)))
@pytest.mark.parametrize("reduce", [pytest.param("max", marks=pytest.mark.slow), "mean"])
def test_timestamps_equal_a_reference_loop_over_eager_rows(model_name, reduce):
    """No eviction: after every forward the timestamps equal the loop over the eager attention rows."""
    model = TINY_MODELS[model_name]()
    tokens = TOKENS[:20]
    cache, _, tables = _drive(model, PROMPT, tokens, budget=500, buffer=8, threshold=THRESHOLD, group_reduce=reduce)
    assert cache.evictions == 0
    ids = PROMPT + tokens
    kv_heads = model.config.num_key_value_heads
    want, margin = _reference_timestamps(eager_attentions(model, ids), len(PROMPT), kv_heads, THRESHOLD, reduce)
    assert margin > 1e-6, "an attention value sits on the threshold: pick another one"
    for forward, table in enumerate(tables):
        t = len(PROMPT) - 1 + forward
        assert torch.equal(table[..., : t + 1].double(), want[forward, ..., : t + 1]), f"forward {forward}"
    final = want[-1]
    # Non-trivial: some tokens were refreshed long after they arrived, others never were.
    arrival = torch.arange(len(ids), dtype=torch.float64)
    assert (final > arrival + 5).any() and (final == arrival).any()


@pytest.mark.slow
def test_timestamps_with_eviction_follow_the_masked_rows_and_evict_least_recently_useful():
    """With eviction: timestamps equal the loop over the rows over what the cache held; the prompt
    is never evicted; at each eviction the dropped tokens are the least recently useful ones."""
    model, budget, buffer = tiny_llama(), 18, 4
    cache, held, tables = _drive(model, PROMPT, TOKENS, budget=budget, buffer=buffer, threshold=THRESHOLD)
    assert cache.evictions >= 5
    ids = PROMPT + TOKENS
    probs = masked_attentions(model, ids, len(PROMPT), held)
    want, margin = _reference_timestamps(probs, len(PROMPT), 2, THRESHOLD)
    assert margin > 1e-6
    for forward, table in enumerate(tables):
        t = len(PROMPT) - 1 + forward
        assert torch.equal(table[..., : t + 1].double(), want[forward, ..., : t + 1]), f"forward {forward}"

    checked = 0
    for step in range(len(held) - 1):
        t = len(PROMPT) + step
        stamps = want[step + 1]  # after this step's forward, when its eviction ran
        for layer in range(len(probs)):
            for head in range(2):
                before = set(held[step][layer][head].tolist()) | {t}
                kept = set(held[step + 1][layer][head].tolist())
                assert set(range(len(PROMPT))) <= kept  # protect_prompt (default True)
                if kept == before:
                    continue
                assert len(kept) == budget
                free = kept - set(range(len(PROMPT)))
                dropped = before - kept
                rank = {p: (float(stamps[layer, head, p]), p) for p in before}
                assert max(rank[p] for p in dropped) < min(rank[p] for p in free)
                checked += 1
    assert checked >= 3 * 2 * 5


@pytest.mark.slow
def test_threshold_never_reached_keeps_prompt_plus_newest():
    """If nothing is ever attended above the threshold, timestamps are arrival times: the kept
    decoded tokens are exactly the newest ones (ties broken towards recency)."""
    model, budget = tiny_llama(), 16
    cache, _, _ = _drive(model, PROMPT, TOKENS, budget=budget, buffer=3, threshold=0.999)
    newest = len(PROMPT) + len(TOKENS) - 1
    held_after = cache.slots - budget  # tokens added since the last eviction
    last_eviction_newest = newest - held_after
    expected = set(range(len(PROMPT))) | set(range(last_eviction_newest - (budget - len(PROMPT)) + 1, newest + 1))
    for layer in range(model.config.num_hidden_layers):
        for head in cache.positions(layer)[0]:
            assert set(head.tolist()) == expected


def test_batch_rows_stamp_as_if_alone():
    """Left padding never leaks into timestamps: a padded row's table equals its table alone."""
    model = tiny_llama()
    short, long = PROMPT[:6], PROMPT
    alone, _, _ = _drive(model, short, TOKENS[:8], budget=500, buffer=8, threshold=THRESHOLD)
    cache = reasonkv.EvictingCache(500, 8, model=model, policy="raas", threshold=THRESHOLD)
    key = cache_keyword(model)
    ids = torch.tensor([long, [0] * (len(long) - len(short)) + short])
    mask = torch.tensor([[1] * len(long), [0] * (len(long) - len(short)) + [1] * len(short)])
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{key: cache})
        for token in TOKENS[:8]:
            model(input_ids=torch.tensor([[token], [token]]), use_cache=True, **{key: cache})
    cache.detach()
    total = len(short) + 8
    got = cache.evictor.policy.timestamps.data[1, ..., :total]
    assert torch.equal(got, alone.evictor.policy.timestamps.data[0, ..., :total])


def test_defaults_and_signals():
    policy = reasonkv.get_policy("raas")
    assert policy.protect_prompt is True and policy.threshold == 1e-4 and policy.group_reduce == "max"
    assert policy.chunk_exact is False and policy.granularity == "head"
    needs = policy.needs(None)
    assert needs.attention_last and not needs.attention_sum and needs.query_window == 0


def test_prompt_longer_than_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="protect_prompt keeps a prompt of 10 tokens, more than the budget 8"):
        _drive(tiny_llama(), PROMPT, TOKENS[:5], budget=8, buffer=2)
    cache, _, _ = _drive(tiny_llama(), PROMPT, TOKENS[:5], budget=8, buffer=2, protect_prompt=False)
    assert cache.evictions >= 1


@pytest.mark.parametrize(
    ("option", "bad", "message"),
    [
        ("threshold", -0.1, r"raas: threshold must be a probability in \[0, 1\)"),
        ("threshold", 1.0, r"raas: threshold must be a probability in \[0, 1\)"),
        ("threshold", float("nan"), r"raas: threshold must be a probability in \[0, 1\), got nan"),
        ("threshold", "high", r"raas: option threshold='high': expected float"),
        ("group_reduce", "sum", "raas: group_reduce must be one of max, mean, got 'sum'"),
        ("protect_prompt", "yes", "raas: option protect_prompt='yes': expected bool"),
    ],
)
def test_bad_options_are_clear_errors(option, bad, message):
    with pytest.raises(ValueError, match=message):
        reasonkv.get_policy("raas", **{option: bad})
