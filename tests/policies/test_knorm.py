"""K-norm: scores equal minus the key L2 norms, recomputed from the model's own projections."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import reasonkv
from attention_reference import drive, masked_hidden_states
from conftest import TINY_MODELS, fast_few, tiny_llama
from reasonkv.policies.view import EvictionView

PROMPT = [3 + (23 * i) % 87 for i in range(14)]
TOKENS = [11 + (41 * i) % 77 for i in range(30)]


# ---------------------------------------------------------------------------------------- helpers
_drive = partial(drive, policy="knorm")


def _key_norms(model, hidden_states):
    """Per layer ``[kv_heads, T]``: ``||k||`` from each layer's input, before RoPE (RoPE keeps norms)."""
    config = model.config
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    norms = []
    with torch.inference_mode():
        for layer, block in enumerate(model.model.layers):
            x = block.input_layernorm(hidden_states[layer][0])
            keys = block.self_attn.k_proj(x).view(-1, kv_heads, head_dim)
            if hasattr(block.self_attn, "k_norm"):  # Qwen3 normalises keys per head before RoPE
                keys = block.self_attn.k_norm(keys)
            norms.append(keys.double().norm(dim=-1).T)
    return norms


def _full_hidden_states(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("model_name", fast_few(["llama-gqa", "llama-mqa", "qwen3-gqa"], fast=("llama-mqa",)))
def test_scores_equal_minus_key_norms(model_name):
    model = TINY_MODELS[model_name]()
    tokens = TOKENS[:10]
    cache, _, _ = _drive(model, PROMPT, tokens, budget=500, buffer=8)
    ids = PROMPT + tokens
    want = _key_norms(model, _full_hidden_states(model, ids))
    evictor = cache.evictor
    view = EvictionView(
        cache=cache,
        recorded=evictor.observer.recorded,
        policy=evictor.policy,
        rows=torch.tensor([0]),
        row_seeds=torch.zeros(1, dtype=torch.long),
        info=evictor.info,
    )
    for layer, norms in enumerate(want):
        layer_view = view.at(layer)
        positions = layer_view.positions()[0]  # [kv_heads, slots]
        got = evictor.policy.score(layer_view)[0].double()
        torch.testing.assert_close(got, -norms.gather(1, positions), atol=1e-5, rtol=1e-5)


def test_first_eviction_keeps_sinks_and_lowest_norms():
    """A prompt of exactly K + B tokens is evicted right after prefill: each (layer, kv-head) keeps
    the sinks and the K - sinks tokens with the smallest key norm."""
    model, budget, buffer, sinks = tiny_llama(), 12, 6, 4
    prompt = [3 + (23 * i) % 87 for i in range(budget + buffer)]
    cache, _, _ = _drive(model, prompt, [], budget=budget, buffer=buffer, sinks=sinks)
    assert cache.evictions == 1
    norms = _key_norms(model, _full_hidden_states(model, prompt))
    for layer, layer_norms in enumerate(norms):
        for head, head_norms in enumerate(layer_norms):
            lowest = (sinks + head_norms[sinks:].argsort()[: budget - sinks]).tolist()
            assert set(cache.positions(layer)[0, head].tolist()) == set(range(sinks)) | set(lowest)
    # The heads really disagree, so the per-head choice is exercised.
    assert not torch.equal(cache.positions(0)[0, 0].sort().values, cache.positions(0)[0, 1].sort().values)


@pytest.mark.slow
def test_every_eviction_drops_the_largest_norms():
    model, budget, buffer, sinks = tiny_llama(), 14, 4, 4
    cache, held, _ = _drive(model, PROMPT, TOKENS, budget=budget, buffer=buffer, sinks=sinks)
    assert cache.evictions >= 5
    ids = PROMPT + TOKENS
    norms = _key_norms(model, masked_hidden_states(model, ids, len(PROMPT), held, dtype=torch.float32))
    checked = 0
    for step in range(len(held) - 1):
        t = len(PROMPT) + step
        for layer, layer_norms in enumerate(norms):
            for head in range(layer_norms.shape[0]):
                before = set(held[step][layer][head].tolist()) | {t}
                kept = set(held[step + 1][layer][head].tolist())
                if kept == before:
                    continue
                assert len(kept) == budget and set(range(sinks)) <= kept
                dropped, free = before - kept, kept - set(range(sinks))
                assert min(layer_norms[head, p] for p in dropped) >= max(layer_norms[head, p] for p in free) - 1e-5
                checked += 1
    assert checked >= 3 * 2 * 5


def test_reads_nothing_but_keys():
    policy = reasonkv.get_policy("knorm")
    needs = policy.needs(None)
    assert not needs.taps_attention and needs.hidden_layers == ()
    assert policy.granularity == "head" and policy.chunk_exact and not policy.stochastic
