"""dtype, device and attention implementation: a bad value is refused before any load, naming the allowed ones."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from reasonkv.models import load_model, resolve_dtype


@pytest.mark.parametrize("dtype", ["fp8", "int8", "FP33", torch.int8, None])
def test_bad_dtype_names_value_and_choices(dtype: Any) -> None:
    with pytest.raises(ValueError, match="Unsupported dtype") as info:
        load_model("shape:tiny", dtype=dtype)
    assert repr(dtype) in str(info.value)
    assert "'bf16'" in str(info.value) and "'fp32'" in str(info.value)


@pytest.mark.parametrize(("dtype", "expected"), [("bf16", torch.bfloat16), ("float16", torch.float16)])
def test_dtype_aliases(dtype: str, expected: torch.dtype) -> None:
    assert resolve_dtype(dtype) is expected
    assert resolve_dtype(expected) is expected


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "mps"])
def test_bad_device_names_value(device: str) -> None:
    with pytest.raises(ValueError, match="Unsupported device") as info:
        load_model("shape:tiny", device=device)
    assert repr(device) in str(info.value)
    assert "'cuda:N'" in str(info.value)


def test_unavailable_cuda_is_a_clear_error() -> None:
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match="CUDA") as info:
        load_model("shape:tiny", device=device)
    assert repr(device) in str(info.value)
    if not torch.cuda.is_available():  # the advice fits both places the error is read
        assert "--device cpu on the command line, device='cpu' in Python" in str(info.value)


def test_meta_device_only_for_shapes() -> None:
    with pytest.raises(ValueError, match="'meta'"):
        load_model("default", device="meta")


def test_bad_attn_implementation() -> None:
    with pytest.raises(ValueError, match="'flash'") as info:
        load_model("shape:tiny", attn_implementation="flash")
    assert "'sdpa'" in str(info.value) and "'flash_attention_2'" in str(info.value)


def test_flash_attention_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError, match="flash_attn package"):
        load_model("shape:tiny", dtype="bf16", attn_implementation="flash_attention_2")
