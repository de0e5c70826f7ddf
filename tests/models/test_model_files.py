"""Damaged model files are reported as such: truncated checkpoints and GGUF files, NaN and inf weights."""

from __future__ import annotations

import importlib.util
import os
import pickle
from pathlib import Path

import pytest
import torch

from checkpoints import poison, save_tiny_checkpoint, truncate
from conftest import tiny_llama
from reasonkv.models import BUNDLED, DEFAULT_MODEL, SMOLLM2_INSTALL_COMMAND, SMOLLM2_PACKAGE, load_model
from reasonkv.models.files import CorruptModelError, check_finite, check_gguf_header

HAS_SMOLLM2 = importlib.util.find_spec(SMOLLM2_PACKAGE) is not None


def test_truncated_checkpoint_directory_names_the_directory(tmp_path: Path) -> None:
    directory = save_tiny_checkpoint(tmp_path / "ckpt")
    truncate(directory / "model.safetensors")
    with pytest.raises(CorruptModelError, match="a file there is truncated or corrupt") as info:
        load_model(directory)
    assert str(directory) in str(info.value)


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_malicious_pickle_is_refused_in_one_line_and_never_run(tmp_path: Path, recwarn, protocol: int) -> None:
    directory = save_tiny_checkpoint(tmp_path / "ckpt")
    (directory / "model.safetensors").unlink()
    ran = tmp_path / "ran"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(ran), protocol=protocol))
    with pytest.raises(CorruptModelError) as info:
        load_model(directory)
    message = str(info.value)
    assert message.startswith(f"cannot load the model in {str(directory)!r}: a pickled weights file there")
    assert "\n" not in message and "weights_only" not in message  # never the advice to load it unchecked
    assert not ran.exists()
    assert [str(w.message) for w in recwarn if "pickle" in str(w.message)] == []  # no warning before the error


class _RunsCode:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_nan_weights_are_refused_not_loaded(tmp_path: Path) -> None:
    directory = save_tiny_checkpoint(tmp_path / "ckpt")
    poison(directory / "model.safetensors")
    with pytest.raises(CorruptModelError, match=r"1 of \d+ weight tensors hold NaN or inf values") as info:
        load_model(directory)
    assert "up_proj" in str(info.value) and str(directory) in str(info.value)


def test_check_finite_finds_inf_in_bf16() -> None:
    model = tiny_llama(dtype=torch.bfloat16)
    check_finite(model, "a healthy model")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[3, 4] = float("-inf")
    with pytest.raises(CorruptModelError, match=r"layers\.1\.self_attn\.k_proj\.weight"):
        check_finite(model, "this model")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is not a GGUF file"),
        (b"PK\x03\x04 a zip file, not a model", r"is not a GGUF file: it starts with b'PK\\x03\\x04'"),
        (b"GGUF\x03\x00", "is truncated: 6 bytes, shorter than its header"),
        (b"GGUF" + (3).to_bytes(4, "little") + bytes(16), "holds no tensors"),
    ],
)
def test_gguf_header_is_checked_before_loading(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(CorruptModelError, match=message):
        check_gguf_header(path)
    with pytest.raises(CorruptModelError, match=message):
        load_model(path)


@pytest.mark.integration
@pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs `{SMOLLM2_INSTALL_COMMAND}`")
@pytest.mark.slow
def test_truncated_gguf_is_reported_as_truncated(tmp_path: Path) -> None:
    path = tmp_path / "smollm2.gguf"
    path.write_bytes(BUNDLED[DEFAULT_MODEL].file().read_bytes()[:1_000_000])
    with pytest.raises(CorruptModelError, match="is truncated or corrupt: its header or tensor table cannot be read"):
        load_model(path)


@pytest.mark.integration
@pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs `{SMOLLM2_INSTALL_COMMAND}`")
@pytest.mark.slow
def test_gguf_with_nan_weights_is_refused(tmp_path: Path) -> None:
    from gguf import GGUFReader

    source = BUNDLED[DEFAULT_MODEL].file()
    norm = next(t for t in GGUFReader(source).tensors if t.name == "blk.3.ffn_norm.weight")
    data = bytearray(source.read_bytes())
    data[norm.data_offset : norm.data_offset + 8] = b"\xff" * 8  # two float32 NaNs
    path = tmp_path / "smollm2.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match=r"1 of \d+ weight tensors hold NaN or inf values") as info:
        load_model(path)
    assert "layers.3.post_attention_layernorm" in str(info.value)


def test_check_finite_is_not_fooled_by_an_fp16_sum_that_overflows() -> None:
    model = tiny_llama(dtype=torch.float16)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.fill_(60000.0)  # finite, but its sum overflows fp16
    check_finite(model, "a model with large fp16 weights")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(CorruptModelError, match="up_proj"):
        check_finite(model, "this model")
