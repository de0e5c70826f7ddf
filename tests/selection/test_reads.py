"""What a decode step reads and counts: dense layers, per-query-head unions, and the budget rules against the
authors' formulas written out here on the same tensors."""

from __future__ import annotations

import pytest
import torch

from reasonkv.policies.quest import Quest
from reasonkv.selection.blocks import choose_blocks
from reasonkv.selection.reader import Selector

BLOCK = 16


def _step(selector, layer, generator, length=79, heads=4, kv_heads=2, dim=8):
    """A prefill of ``length`` tokens then one decode step at position ``length`` through ``selector``."""
    keys = torch.randn(1, kv_heads, length + 1, dim, generator=generator)
    values = torch.randn(1, kv_heads, length + 1, dim, generator=generator)
    positions = torch.arange(length + 1).view(1, 1, -1).expand(1, kv_heads, -1)
    prefill = torch.randn(1, heads, length, dim, generator=generator)
    selector.read(
        layer, prefill, keys[:, :, :length], values[:, :, :length], positions[..., :length], positions[0, :1, :length]
    )
    query = torch.randn(1, heads, 1, dim, generator=generator)
    out = selector.read(layer, query, keys, values, positions, torch.tensor([[length]]))
    return query, keys, values, out


def test_a_dense_layer_reads_and_counts_every_token():
    selector = Selector(Quest(dense_layers=1), budget=2 * BLOCK)
    generator = torch.Generator().manual_seed(0)
    _, _, _, out = _step(selector, 0, generator)
    assert out is None  # the kernel attends over everything
    assert int(selector.read_tokens[0]) == 2 * 80  # two kv-heads, 80 tokens each
    _, _, _, out = _step(selector, 1, generator)
    assert out is not None
    assert int(selector.read_tokens[0]) == 2 * 80 + 2 * 2 * BLOCK  # layer 1 selects: two pages a kv-head


def test_per_query_head_pages_read_their_union_once_and_attend_to_their_own():
    selector = Selector(Quest(group="head", dense_layers=0), budget=3 * BLOCK)
    query, keys, values, (got_keys, got_values, mask) = _step(selector, 0, torch.Generator().manual_seed(1))
    union_tokens = 0
    for kv in range(2):
        heads_pages = []
        for head in (2 * kv, 2 * kv + 1):
            q = query[0, head, 0].double()
            bounds = []
            for page in range(4):  # the complete pages before the current one (position 79: page 4)
                block = keys[0, kv, page * BLOCK : (page + 1) * BLOCK].double()
                bounds.append(float(torch.maximum(q * block.min(0).values, q * block.max(0).values).sum()))
            top = sorted(sorted(range(4), key=lambda j: -bounds[j])[:2]) + [4]
            heads_pages.append(top)
            # This head's attention over its own pages, and over what the selector handed the kernel.
            own = torch.cat([torch.arange(p * BLOCK, (p + 1) * BLOCK) for p in top])
            expected = ((q.float() @ keys[0, kv, own].T) * 0.5).softmax(-1) @ values[0, kv, own]
            weights = ((q.float() @ got_keys[0, kv].T) * 0.5 + mask[0, head, 0]).softmax(-1)
            torch.testing.assert_close(weights @ got_values[0, kv], expected)
        union_tokens += BLOCK * len(set(heads_pages[0]) | set(heads_pages[1]))
    assert int(selector.read_tokens[0]) == union_tokens  # each distinct token of a kv-head's union once
    assert union_tokens > 2 * 3 * BLOCK  # the heads disagree somewhere: more than one choice's tokens


def _authors_budget(scores, current, budget_blocks):
    """SeerAttention-R's get_sparse_attn_mask_from_budget, then mask[..., -1] = True, over blocks 0..current."""
    visible = scores[: current + 1]
    mask = torch.zeros(current + 1, dtype=torch.bool)
    if current + 1 <= budget_blocks:
        mask[:] = True
    else:
        mask[visible.topk(budget_blocks).indices] = True
    mask[current] = True
    return sorted(torch.nonzero(mask).flatten().tolist())


@pytest.mark.parametrize("budget", [64, 128, 256])
def test_the_plus_rule_reads_the_authors_blocks_at_k(budget):
    generator = torch.Generator().manual_seed(2)
    scores = torch.rand(3, 2, 12, generator=generator)
    current = torch.tensor([11, 5, 1])
    choice = choose_blocks(scores, current, budget // 64, rule="plus")
    counts = []
    for b in range(3):
        for h in range(2):
            got = choice.blocks[b, h][choice.chosen[b, h]].tolist()
            assert got == _authors_budget(scores[b, h], int(current[b]), budget // 64)
            assert got[-1] == int(current[b])
            counts.append(len(got))
    assert min(counts) >= min(budget // 64, 2) and max(counts) <= budget // 64 + 1


def test_at_k_128_plus_reads_one_block_more_than_within_when_the_current_one_is_not_chosen():
    scores = torch.tensor([[[0.9, 0.8, 0.7, 0.1]]])  # the current block (3) scores lowest
    current = torch.tensor([3])
    plus = choose_blocks(scores, current, 2, rule="plus")
    within = choose_blocks(scores, current, 2, rule="within")
    assert plus.blocks[0, 0][plus.chosen[0, 0]].tolist() == [0, 1, 3]
    assert within.blocks[0, 0][within.chosen[0, 0]].tolist() == [0, 3]
    scores[0, 0, 3] = 1.0  # chosen on its own merit: read once
    plus = choose_blocks(scores, current, 2, rule="plus")
    assert plus.blocks[0, 0][plus.chosen[0, 0]].tolist() == [0, 3]


def test_without_a_budget_every_block_that_passes_is_read():
    scores = torch.tensor([[[0.3, 0.01, 0.2, 0.25, 0.04, 0.2]]])
    keep = scores > 0.05
    choice = choose_blocks(scores, torch.tensor([5]), None, keep, rule="plus")
    assert choice.blocks[0, 0][choice.chosen[0, 0]].tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="block rule must be one of within, plus, got 'both'"):
        choose_blocks(scores, torch.tensor([5]), 2, rule="both")
