"""Quest: the pages a decode step reads are the top pages of its formula, computed here independently, in
every layer past the dense ones; per query head, each head attends to its own pages."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from reasonkv.policies.quest import quest_scores

LENGTHS = (170, 101, 140)
BLOCK, BUDGET = 16, 80  # 5 blocks a step: the current one and the top 4


def _reference_blocks(query, keys, positions, group_rule):
    """Per (row, query head): the sorted top blocks by sum_d max(q_d min_d, q_d max_d), from the full keys,
    the heads of a kv-head combined by ``group_rule`` (``head``: each its own)."""
    batch, heads, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    chosen = {}
    for b in range(batch):
        real = positions[b] >= 0
        newest = int(positions[b].max())
        current = newest // BLOCK
        for h in range(kv_heads):
            scores = []
            for j in range(current):
                inside = real & (positions[b] // BLOCK == j)
                block = keys[b, h][inside].double()
                low, high = block.min(0).values, block.max(0).values
                bounds = [
                    torch.maximum(query[b, h * group + g].double() * low, query[b, h * group + g].double() * high).sum()
                    for g in range(group)
                ]
                combined = {"max": [max(bounds)] * group, "sum": [sum(bounds)] * group, "head": bounds}[group_rule]
                scores.append(combined)
            for g in range(group):
                top = sorted(range(current), key=lambda j: -float(scores[j][g]))[: BUDGET // BLOCK - 1]
                chosen[b, h * group + g] = sorted(top) + [current]
    return chosen


def _attended(choice, mask, b, head, group):
    """The blocks query head ``head`` attends to: those of its kv-head's read where its mask lets a slot through."""
    blocks = choice.blocks[b, head // group].repeat_interleave(BLOCK)
    return sorted(set(blocks[mask[b, head, 0] == 0].tolist()))


@pytest.mark.parametrize("group_rule", ["max", "sum", "head"])
def test_the_chosen_blocks_equal_the_formula_on_the_same_tensors(group_rule):
    model = tiny_llama(layers=4, kv_heads=2, heads=4)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in LENGTHS]
    seen = []

    def spy(step, cache):
        if step != 0:
            return
        selector = cache.evictor.selector
        read = selector.read

        def recording(layer, query, key, value, slot_positions, step_positions):
            out = read(layer, query, key, value, slot_positions, step_positions)
            if out is not None:
                choice = selector.last[layer]
                seen.append((layer, query[:, :, 0].clone(), key.clone(), slot_positions[:, 0].clone(), choice, out[2]))
            return out

        selector.read = recording

    reasonkv.generate(
        model,
        None,
        prompts,
        policy="quest",
        budget=BUDGET,
        group=group_rule,
        max_new_tokens=50,
        ignore_eos=True,
        on_step=spy,
    )
    assert sorted({layer for layer, *_ in seen}) == [2, 3]  # layers 0 and 1 read everything (Quest's dense layers)
    assert len(seen) == 2 * 49  # every other layer at every decode step
    for _, query, keys, positions, choice, mask in seen[::7]:
        reference = _reference_blocks(query, keys, positions, group_rule)
        for (b, head), blocks in reference.items():
            assert _attended(choice, mask, b, head, 2) == blocks, (b, head)
            if group_rule != "head":  # one choice per kv-head: what it reads is exactly that choice
                assert choice.blocks[b, head // 2][choice.chosen[b, head // 2]].tolist() == blocks


def test_the_bound_is_an_upper_bound_of_every_key_in_the_block():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 4, 8, 16, generator=generator)  # batch, kv_heads, blocks, tokens, dim
    query = torch.randn(2, 6, 16, generator=generator)  # 2 query heads per kv-head
    bound = quest_scores(query, keys.amin(3), keys.amax(3), "max")
    grouped = query.view(2, 3, 2, 16)
    exact = torch.einsum("bkgd,bkntd->bkgnt", grouped, keys).amax(-1).amax(2)  # the best key of each block
    assert (bound >= exact - 1e-5).all()
    with pytest.raises(ValueError, match="group must be one of max, sum, head"):
        quest_scores(query, keys.amin(3), keys.amax(3), "mean")
