"""The quantized tier's storage: the pending group, whole key groups of neighbouring tokens, codes that never
change, the bytes it holds (against the nominal bytes, over many evictions), and its K/V for attention."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import reasonkv
from conftest import tiny_llama
from reasonkv.cache.quantize import QuantFormat
from reasonkv.cache.quantized_tier import QuantizedTier
from reasonkv.cache.quantized_tier import take_slots as _take
from reasonkv.cache.tiers import full_token_bytes, quantized_token_bytes
from reasonkv.hf import cache_keyword

pytestmark = pytest.mark.usefixtures("one_torch_thread")

G = 4  # tokens per key group in the unit tests


def _full(keys, values, positions):
    """A ``take_full`` over one batch of full-precision K/V ``[b, h, s, d]`` and positions ``[b, h, s]``."""
    return lambda slots: (_take(keys, slots), _take(values, slots), positions.gather(2, slots))


def _update(tier: QuantizedTier, select: torch.Tensor, keys, values, positions) -> QuantizedTier:
    rows = torch.arange(select.shape[0])
    update = tier.plan(rows, select, _full(keys, values, positions))
    return tier.apply(update, int(update.needed.max()))


def _data(slots: int, first_position: int = 0, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, slots, 8, generator=generator), torch.randn(1, 2, slots, 8, generator=generator)
    positions = torch.arange(first_position, first_position + slots).expand(1, 2, slots).clone()
    return keys, values, positions


def test_demoted_tokens_wait_at_full_precision_until_a_whole_group_forms_of_the_oldest():
    keys, values, positions = _data(10)
    tier = QuantizedTier.empty(QuantFormat(8, G), keys)
    # Six tokens demoted, chosen out of position order in head 1: the four oldest form a group, two wait.
    chosen = torch.tensor([[[0, 1, 2, 3, 4, 5], [1, 3, 4, 6, 8, 9]]])
    tier = _update(tier, chosen, keys, values, positions)
    assert tier.width == 6 and tier.pending_count.tolist() == [[2, 2]] and tier.groups == 1
    assert tier.positions[0].tolist() == [[0, 1, 2, 3, 4, 5], [1, 3, 4, 6, 8, 9]]
    assert tier.coded_mask()[0].tolist() == [[True] * 4 + [False] * 2] * 2
    got_keys, got_values = tier.dequantize()
    for head, slots in enumerate(chosen[0].tolist()):
        # pending: exactly the model's K/V; coded: within int8 rounding, and not exact
        assert torch.equal(got_keys[0, head, 4:], keys[0, head, slots[4:]])
        assert torch.equal(got_values[0, head, 4:], values[0, head, slots[4:]])
        error = (got_keys[0, head, :4] - keys[0, head, slots[:4]]).abs().max()
        assert 0 < error < 0.05


def test_coded_tokens_keep_their_codes_and_pending_ones_join_the_next_group():
    keys, values, positions = _data(10)
    empty = QuantizedTier.empty(QuantFormat(4, G), keys)
    tier = _update(empty, torch.arange(6).expand(1, 2, 6), keys, values, positions)
    before_keys, before_values = tier.dequantize()
    # Keep the coded tokens 0..3 and the pending 4, 5; demote three more (full slots 0..2 of a new full tier).
    new_keys, new_values, new_positions = _data(5, first_position=20, seed=1)
    chosen = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8]).expand(1, 2, 9)
    second = _update(tier, chosen, new_keys, new_values, new_positions)
    assert second.positions[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 20, 21, 22]
    assert second.pending_count.tolist() == [[1, 1]] and second.groups == 2  # 4, 5, 20, 21 coded; 22 waits
    after_keys, after_values = second.dequantize()
    assert torch.equal(after_keys[:, :, :4], before_keys[:, :, :4])  # never refitted
    assert torch.equal(after_values[:, :, :4], before_values[:, :, :4])
    assert torch.equal(after_keys[:, :, 8], new_keys[:, :, 2])  # pending: exact
    # Drop the first group entirely: its statistics are released.
    third = _update(second, torch.tensor([4, 5, 6, 7, 8]).expand(1, 2, 5), new_keys, new_values, new_positions)
    coded = third.coded_mask()
    assert int(coded.sum()) == 2 * 4 and third.key_group.masked_select(coded).unique().tolist() == [0]


def test_int4_codes_take_half_the_bytes_of_int8():
    keys, values, positions = _data(40)
    chosen = torch.arange(32).expand(1, 2, 32)
    int8 = _update(QuantizedTier.empty(QuantFormat(8, G), keys), chosen, keys, values, positions)
    int4 = _update(QuantizedTier.empty(QuantFormat(4, G), keys), chosen, keys, values, positions)
    assert int4.key_codes.numel() * 2 == int8.key_codes.numel() == 2 * 32 * 8
    assert int8.nbytes() - int4.nbytes() == 2 * 32 * 8  # all the difference is in the codes (keys and values)
    assert int(int8.row_bytes()) - int(int4.row_bytes()) == 2 * 32 * 8


def test_row_bytes_count_coded_tokens_live_groups_and_pending_tokens():
    keys, values, positions = _data(10)
    fmt = QuantFormat(8, G)
    tier = _update(QuantizedTier.empty(fmt, keys), torch.arange(7).expand(1, 2, 7), keys, values, positions)
    # per head: 4 coded (codes 2 x 8, an int16 id, value stats 2 x 2 groups x 4 bytes), 1 group, 3 pending
    coded = 4 * (2 * 8 + 2 + 2 * 2 * 4)
    assert int(tier.row_bytes()) == 2 * (coded + 2 * 8 * 4 + 3 * full_token_bytes(8, 4))
    assert tier.nbytes() >= int(tier.row_bytes())


# ---------------------------------------------------------------------------------- in the cache, at scale


def _model_head_dim_64(layers: int = 3):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _recount(cache) -> int:
    """The tier's bytes of row 0, counted from what it holds: tokens, distinct live groups, pending tokens."""
    total = 0
    for index in cache.full_layers:
        tier = cache.layers[index].quantized
        per_token = tier.key_codes.shape[-1] * 2 + tier.key_group.element_size() + tier.value_stats[0, 0, 0].numel() * 4
        coded = tier.coded_mask()[0]
        for head in range(coded.shape[0]):
            groups = set(tier.key_group[0, head][coded[head]].tolist())
            pending = int(tier.pending_count[0, head])
            assert pending < tier.fmt.group_size
            total += int(coded[head].sum()) * per_token + len(groups) * 2 * 64 * 4 + pending * full_token_bytes(64, 4)
    return total


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "vase-dkv"])
def test_bytes_held_over_25_evictions_are_the_bytes_reported_and_key_groups_form_whole(policy):
    """The setting of docs/results/equal-bytes: head_dim 64, K = 16, B = 16, Q = 83 int4 (group 32), fp32."""
    model = _model_head_dim_64()
    options = {"window": 8} if policy == "snapkv" else {}
    cache = reasonkv.EvictingCache(16, 16, model=model, policy=policy, quantized=83, bits=4, **options)
    nominal = 83 * quantized_token_bytes(64, 4, QuantFormat(4, 32))
    after, coded_ratio = [], []
    key = cache_keyword(model)
    ids = torch.randint(5, 90, (1, 40), generator=torch.Generator().manual_seed(0))  # 40 > K + B: evicted at once
    evictions = 0
    with torch.inference_mode():
        while cache.evictions < 26:
            out = model(input_ids=ids, **{key: cache})
            ids = out.logits[:, -1:].argmax(-1)
            if cache.evictions > evictions:
                evictions = cache.evictions
                held = int(cache.row_kv_bytes_by_tier()["quantized"][0])
                assert held == _recount(cache)
                after.append(held)
                pending = sum(int(cache.layers[i].quantized.pending_count.sum()) for i in cache.full_layers)
                coded = sum(int(cache.layers[i].quantized.coded_mask().sum()) for i in cache.full_layers)
                if coded:
                    coded_ratio.append((held - pending * full_token_bytes(64, 4)) / (coded * nominal / 83))
    cache.detach()
    [steady] = cache.steady_kv_bytes()
    assert steady["quantized"] == pytest.approx(sum(after) / len(after))
    assert steady["full"] == 16 * 3 * full_token_bytes(64, 4)
    assert steady["tokens"] == pytest.approx(16 + steady["quantized"] / (3 * full_token_bytes(64, 4)))
    # Coded tokens cost about their nominal bytes: key groups form whole, and lose few members on these
    # traces (a group of 16 tokens, one eviction's demotions, made them cost up to 1.4x before).
    assert sum(coded_ratio[1:]) / len(coded_ratio[1:]) < 1.3, coded_ratio
    assert min(coded_ratio) >= 1.0


# ---------------------------------------------------------------------------------- the step


class _Allocations(TorchDispatchMode):
    """The dtype and size of every tensor an op makes inside the block (views excluded)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.made.append((t.dtype, t.numel()))
        return out


def test_a_decode_step_dequantizes_in_the_cache_dtype_into_one_shared_buffer():
    model = tiny_llama(dtype=torch.bfloat16, layers=4)
    cache = reasonkv.EvictingCache(16, 8, model=model, policy="streaming", quantized=64, bits=4, group_size=8)
    key = cache_keyword(model)
    ids = torch.randint(5, 90, (2, 120), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(input_ids=ids, **{key: cache})
        out = model(input_ids=out.logits[:, -1:].argmax(-1), **{key: cache})  # steady: the tier is full
        assert cache.low_width == 64
        buffers = cache.workspace._keys.data_ptr(), cache.workspace._values.data_ptr()
        with _Allocations() as allocations:
            model(input_ids=out.logits[:, -1:].argmax(-1), **{key: cache})
    cache.detach()
    assert (cache.workspace._keys.data_ptr(), cache.workspace._values.data_ptr()) == buffers  # no new buffer
    tier_elements = 2 * 2 * 64 * 16  # batch x kv_heads x Q x head_dim: one layer's tier keys
    large = [(dtype, n) for dtype, n in allocations.made if n >= tier_elements]
    # Per layer: the key codes unpacked, the scales and zero points of its tokens (each the size of the
    # keys, no larger), in bf16 or uint8; nothing of the tier's size in float32, nothing the size of all K/V.
    assert large and all(dtype in (torch.bfloat16, torch.uint8) and n <= tier_elements for dtype, n in large), large
