"""The K/V bytes a replay held and read per decode step, measured on the cache, against counts made apart."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from reasonkv.eval.fidelity import trace_fidelity
from reasonkv.hf import cache_keyword

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS, KV_HEADS = 3, 2


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(9, 1), _ids(4, 2), _ids(13, 3)]  # left-padded against each other
TRACES = [_ids(41, 4), _ids(23, 5), _ids(34, 6)]  # rows stop at different steps


def _token_bytes(model) -> int:
    """One token's K and V in one kv-head of one layer."""
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    return 2 * head_dim * next(model.parameters()).element_size()


@torch.inference_mode()
def _held_alone(model, prompt, trace, policy, budget, buffer, seed) -> float:
    """One row alone, one token per forward: the tokens each decode step's attention saw (held before it,
    plus the new one) over every layer and kv-head, in bytes, mean over the steps."""
    cache = reasonkv.EvictingCache(budget, buffer, model=model, policy=policy, seed=seed)
    key = cache_keyword(model)
    model(input_ids=torch.tensor([prompt]), use_cache=True, **{key: cache})
    seen = []
    for token in trace[:-1]:
        held = sum(int((cache.positions(layer)[0] >= 0).sum()) for layer in range(LAYERS))
        seen.append(held + LAYERS * KV_HEADS)
        model(input_ids=torch.tensor([[token]]), use_cache=True, **{key: cache})
    cache.detach()
    return sum(seen) / len(seen) * _token_bytes(model)


@pytest.mark.parametrize("policy", ["h2o", "streaming"])
def test_an_eviction_cache_reads_what_it_holds_as_each_row_alone_counts_it(policy):
    model = tiny_llama(kv_heads=KV_HEADS, layers=LAYERS)
    budget, buffer = 10, 4
    rows = trace_fidelity(model, PROMPTS, TRACES, policy=policy, budget=budget, buffer=buffer, seed=3)
    for r, row in enumerate(rows):
        assert row.evictions > 3
        want = _held_alone(model, PROMPTS[r], TRACES[r], policy, budget, buffer, seed=3)
        assert row.step_bytes["held"] == pytest.approx(want, rel=1e-12)
        assert row.step_bytes["read"] == row.step_bytes["held"]
        assert row.step_bytes["held"] < (budget + buffer + 1) * LAYERS * KV_HEADS * _token_bytes(model)


def test_a_chunked_replay_counts_the_steps_inside_a_chunk_exactly():
    model = tiny_llama(kv_heads=KV_HEADS, layers=LAYERS)
    args = dict(policy="streaming", budget=10, buffer=4, seed=3)
    chunked = trace_fidelity(model, PROMPTS, TRACES, chunked=True, **args)
    stepwise = trace_fidelity(model, PROMPTS, TRACES, chunked=False, **args)

    def flat(rows):
        return [row.step_bytes[kind] for row in rows for kind in ("held", "read")]

    assert flat(chunked) == pytest.approx(flat(stepwise), rel=1e-12)


@pytest.mark.parametrize("budget", [8, 12])
def test_a_selection_cache_holds_every_token_and_reads_its_blocks(budget):
    """quest with blocks of 4, every layer selecting: each step reads, per (layer, kv-head), the current block
    and min(K // 4 - 1, complete blocks before it) others; it holds the prompt and every token fed."""
    model = tiny_llama(kv_heads=KV_HEADS, layers=LAYERS)
    block = 4
    rows = trace_fidelity(
        model, PROMPTS, TRACES, policy="quest", budget=budget, buffer=4, block_size=block, dense_layers=0
    )
    size = LAYERS * KV_HEADS * _token_bytes(model)
    for r, row in enumerate(rows):
        held, read = [], []
        for i in range(len(TRACES[r]) - 1):
            tokens = len(PROMPTS[r]) + i + 1
            newest = tokens - 1
            current = newest // block
            held.append(tokens)
            read.append(min(budget // block - 1, current) * block + newest - current * block + 1)
        assert row.step_bytes["held"] == pytest.approx(sum(held) / len(held) * size, rel=1e-12)
        assert row.step_bytes["read"] == pytest.approx(sum(read) / len(read) * size, rel=1e-12)
        assert row.step_bytes["read"] < row.step_bytes["held"]


def test_a_selection_budget_covering_every_block_reads_all_it_holds():
    model = tiny_llama(kv_heads=KV_HEADS, layers=LAYERS)
    rows = trace_fidelity(model, PROMPTS, TRACES, policy="quest", budget=64, buffer=4, block_size=4)
    for row in rows:
        assert row.step_bytes["read"] == pytest.approx(row.step_bytes["held"], rel=1e-12)


def test_a_one_token_trace_has_no_decode_step():
    model = tiny_llama(kv_heads=KV_HEADS, layers=LAYERS)
    rows = trace_fidelity(model, PROMPTS[:2], [TRACES[0], TRACES[1][:1]], policy="h2o", budget=10, buffer=4)
    assert rows[0].step_bytes is not None and rows[1].step_bytes is None
