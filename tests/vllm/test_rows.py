"""A request as a one-row cache, fed its signals as vLLM's worker feeds them (no engine): the attention H2O
accumulates through reasonkv's own observer equals the attention each query paid, computed by brute force, over a
prefill, decode steps and an eviction; and the tokens kept are written back in the order they came."""

from __future__ import annotations

import torch
from engines import needs_vllm

needs_vllm()

from reasonkv.cache.observe import Observer  # noqa: E402
from reasonkv.integrations.vllm.rows import RequestCache, kept_indices  # noqa: E402
from reasonkv.policies import noise  # noqa: E402
from reasonkv.policies.attention import Kernel  # noqa: E402
from reasonkv.policies.contract import ModelInfo  # noqa: E402
from reasonkv.policies.h2o import H2O  # noqa: E402

LAYERS, HEADS, KV_HEADS, DIM, BUDGET = 3, 4, 2, 8, 12
INFO = ModelInfo(LAYERS, HEADS, KV_HEADS, DIM, ("full",) * LAYERS)


class Blocks:
    """A stand-in for a request's paged blocks: dense per-layer K/V, read as the worker reads them."""

    def __init__(self):
        self.keys = [torch.empty(KV_HEADS, 0, DIM) for _ in range(LAYERS)]
        self.values = [torch.empty(KV_HEADS, 0, DIM) for _ in range(LAYERS)]

    def read(self, layer: int, count: int):
        return self.keys[layer][:, :count].clone(), self.values[layer][:, :count].clone()


def _forward(cache, observer, blocks, generator, new: int, arrived: list):
    """One forward of ``new`` tokens, as the worker runs it: the cache grows, each layer's queries are recorded
    (with the keys this forward sees), the layer writes its keys, then the policy observes the step."""
    start = cache.seen
    cache.grow(new)
    positions = torch.arange(start, start + new).unsqueeze(0)
    observer.begin(torch.ones(1, new, dtype=torch.bool), positions, start + new, claim=False)
    for layer in range(LAYERS):
        queries = torch.randn(1, HEADS, new, DIM, generator=generator)
        keys = torch.randn(KV_HEADS, new, DIM, generator=generator)
        seen = torch.cat([blocks.keys[layer], keys], dim=1).unsqueeze(0) if new > 1 else None
        observer.record(layer, queries, cache.held, Kernel(DIM**-0.5), seen)
        blocks.keys[layer] = torch.cat([blocks.keys[layer], keys], dim=1)
        blocks.values[layer] = torch.cat(
            [blocks.values[layer], torch.randn(KV_HEADS, new, DIM, generator=generator)], 1
        )
        arrived.append((layer, queries, positions[0]))
    observer.policy.observe(observer.end())
    observer.settle()


def test_h2o_accumulates_the_attention_each_query_paid_across_an_eviction():
    generator = torch.Generator().manual_seed(0)
    blocks = Blocks()
    cache = RequestCache(blocks.read, INFO, KV_HEADS, BUDGET)
    policy = H2O()
    policy.reset(INFO, 1, torch.device("cpu"))
    observer = Observer(None, cache, policy.needs(INFO))
    observer.policy = policy
    arrived: list = []
    _forward(cache, observer, blocks, generator, 15, arrived)  # a prompt above K
    for _ in range(4):
        _forward(cache, observer, blocks, generator, 1, arrived)
    observer.flush()
    # Brute force: each query's softmax over the keys at or before it, averaged over the heads of a kv group.
    positions = cache.held_positions
    for layer in range(LAYERS):
        keys = blocks.keys[layer]
        expected = torch.zeros(KV_HEADS, keys.shape[1])
        for at, queries, query_positions in arrived:
            if at != layer:
                continue
            grouped = keys.repeat_interleave(HEADS // KV_HEADS, dim=0)
            logits = torch.einsum("hqd,hsd->hqs", queries[0], grouped) * DIM**-0.5
            visible = torch.arange(keys.shape[1]).view(1, -1) <= query_positions.view(-1, 1)
            rows = logits.masked_fill(~visible, float("-inf")).softmax(-1).sum(1)  # [heads, slots]
            expected += rows.view(KV_HEADS, HEADS // KV_HEADS, -1).mean(1)
        got = policy.accumulated.lookup(torch.tensor([0]), positions[layer].unsqueeze(0), layer)[0]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # The eviction keeps K slots per layer and head, in the order they came, and the cache follows them.
    kept = kept_indices(policy, cache, INFO, observer.recorded, noise.seed_tensor(0, 1, "cpu"))
    assert kept.shape == (LAYERS, KV_HEADS, BUDGET) and bool((kept.diff(dim=-1) > 0).all())
    before = cache.held_positions.clone()
    cache.keep(kept)
    assert torch.equal(cache.held_positions, before.gather(-1, kept)) and cache.evictions == 1
    assert cache.held == BUDGET and cache.seen == 19 and int(cache.next_position) == 19
