"""int8 / int4 formats: per-token value groups, per-channel key groups, packing, statistics, bad input."""

from __future__ import annotations

import pytest
import torch

from reasonkv.cache.quantize import (
    QuantFormat,
    default_group_size,
    dequantize_channels,
    dequantize_tokens,
    pack,
    quantize_channels,
    quantize_tokens,
    unpack,
)


def _half_step(groups: torch.Tensor, fmt: QuantFormat, dim: int) -> torch.Tensor:
    """Half a rounding step of each group (reduced over ``dim``), with float slack."""
    span = groups.amax(dim, keepdim=True) - groups.amin(dim, keepdim=True)
    return span / fmt.levels / 2 * 1.0001 + 1e-6


@pytest.mark.parametrize("bits", [4, 8])
def test_values_round_trip_within_half_a_step_of_their_token_group(bits):
    fmt = QuantFormat(bits, 8)
    x = torch.randn(3, 5, 32) * torch.linspace(0.1, 10, 32)
    packed, stats = quantize_tokens(x, fmt)
    assert stats.shape == (3, 5, 2, 4)  # scale and zero point of 32 / 8 groups per token
    back = dequantize_tokens(packed, stats, fmt, x.dtype)
    groups, back_groups = x.unflatten(-1, (4, 8)), back.unflatten(-1, (4, 8))
    error = (back_groups - groups).abs()
    assert (error <= _half_step(groups, fmt, -1)).all()
    assert error.max() > 0  # it really rounds


@pytest.mark.parametrize("bits", [4, 8])
def test_keys_round_trip_within_half_a_step_of_their_channel_group(bits):
    fmt = QuantFormat(bits, 4)
    keys = torch.randn(2, 10, 16)
    keys[..., 3] *= 50  # an outlier channel: per-channel groups keep it from swamping the others
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2]).expand(2, 10)
    packed, stats = quantize_channels(keys, group, 3, fmt)
    assert stats.shape == (2, 3, 2, 16)
    per_token = stats.gather(1, group.view(2, 10, 1, 1).expand(2, 10, 2, 16))
    back = dequantize_channels(packed, per_token, fmt, keys.dtype)
    for g in range(3):
        members = group[0] == g
        error = (back[:, members] - keys[:, members]).abs()
        assert (error <= _half_step(keys[:, members], fmt, 1)).all()
    small = torch.arange(16) != 3
    assert (back - keys)[..., small].abs().max() < 0.3 * (1 if bits == 8 else 16)


def test_tokens_outside_every_group_leave_the_statistics_alone():
    fmt = QuantFormat(8, 4)
    keys = torch.randn(1, 4, 8)
    keys[0, 3] = 1000.0  # belongs to no group
    _, stats = quantize_channels(keys, torch.tensor([[0, 0, 0, 1]]), 1, fmt)
    assert stats[0, 0, 1].max() < 10  # zero point (the minimum) and scale come from the members only
    assert (stats[0, 0, 0] * fmt.levels + stats[0, 0, 1]).max() < 10


def test_int4_takes_half_the_bytes_of_int8_and_packing_round_trips():
    codes = torch.randint(0, 16, (3, 7, 64), dtype=torch.uint8)
    packed4, packed8 = pack(codes, 4), pack(codes, 8)
    assert packed4.shape == (3, 7, 32) and packed8.shape == (3, 7, 64)
    assert packed4.numel() * packed4.element_size() * 2 == packed8.numel() * packed8.element_size()
    assert torch.equal(unpack(packed4, 4), codes)
    assert torch.equal(unpack(packed8, 8), codes)


def test_constant_groups_come_back_exactly():
    fmt = QuantFormat(4, 4)
    x = torch.full((2, 8), 3.25)
    packed, stats = quantize_tokens(x, fmt)
    assert torch.equal(dequantize_tokens(packed, stats, fmt, x.dtype), x)


def test_statistics_are_stored_in_the_kv_dtype_and_the_codes_fit_the_stored_ones():
    fmt = QuantFormat(8, 16)
    x = (torch.randn(4, 32) * 7 + 3).to(torch.bfloat16)
    packed, stats = quantize_tokens(x, fmt)
    assert stats.dtype == torch.bfloat16
    # The codes were fitted to the rounded statistics: no other code of those statistics is closer.
    codes = unpack(packed, 8).float().unflatten(-1, (2, 16))
    scale, zero = stats[..., 0, :, None].float(), stats[..., 1, :, None].float()
    ideal = ((x.float().unflatten(-1, (2, 16)) - zero) / scale).clamp(0, fmt.levels)
    assert (codes - ideal).abs().max() <= 0.5 + 1e-3


@pytest.mark.parametrize("bits", [0, 2, 3, 16, True, "8"])
def test_bits_other_than_4_or_8_are_refused(bits):
    with pytest.raises(ValueError, match=f"bits must be 4 or 8, got {bits!r}"):
        QuantFormat(bits, 32)


def test_a_group_size_that_does_not_divide_head_dim_is_refused_with_the_allowed_ones():
    QuantFormat(8, 16).check_head_dim(64)
    with pytest.raises(ValueError, match="group_size 24 does not divide head_dim 64; allowed: 1, 2, 4, 8, 16, 32, 64"):
        QuantFormat(8, 24).check_head_dim(64)
    with pytest.raises(ValueError, match="group_size must be a positive integer, got 0"):
        QuantFormat(8, 0)


def test_default_group_size_is_32_or_the_largest_divisor_below():
    assert [default_group_size(d) for d in (64, 128, 256, 80, 96, 16)] == [32, 32, 32, 20, 32, 16]
