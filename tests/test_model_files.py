"""Damaged model files are reported as such, the conversion cache heals itself, and offline hub ids fail fast."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_llama
from reasonkv import models
from reasonkv.model_files import CorruptModelError, check_finite, check_gguf_header
from reasonkv.models import load_model

SRC = Path(__file__).resolve().parents[1] / "src"
HAS_SMOLLM2 = models.importlib.util.find_spec(models.SMOLLM2_PACKAGE) is not None


def save_tiny_checkpoint(directory: Path) -> Path:
    """A tiny Llama and a word-level tokenizer, saved as a regular checkpoint directory."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tiny_llama().save_pretrained(directory)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "thought", "about", "it"]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: 3 + i for i, w in enumerate(words)}}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(directory)
    return directory


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def poison(path: Path) -> None:
    """Write NaN into one weight tensor of a safetensors file, keeping its size and structure."""
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if n.endswith("mlp.up_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


# --------------------------------------------------------------------------- damaged files


def test_truncated_checkpoint_directory_names_the_directory(tmp_path: Path) -> None:
    directory = save_tiny_checkpoint(tmp_path / "ckpt")
    truncate(directory / "model.safetensors")
    with pytest.raises(CorruptModelError, match="a file there is truncated or corrupt") as info:
        load_model(directory)
    assert str(directory) in str(info.value)


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
@pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs `{models.SMOLLM2_INSTALL_COMMAND}`")
def test_truncated_gguf_is_reported_as_truncated(tmp_path: Path) -> None:
    path = tmp_path / "smollm2.gguf"
    path.write_bytes(models._smollm2_gguf_path().read_bytes()[:1_000_000])
    with pytest.raises(CorruptModelError, match="is truncated or corrupt: its header or tensor table cannot be read"):
        load_model(path)


@pytest.mark.integration
@pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs `{models.SMOLLM2_INSTALL_COMMAND}`")
def test_gguf_with_nan_weights_is_refused(tmp_path: Path) -> None:
    from gguf import GGUFReader

    source = models._smollm2_gguf_path()
    norm = next(t for t in GGUFReader(source).tensors if t.name == "blk.3.ffn_norm.weight")
    data = bytearray(source.read_bytes())
    data[norm.data_offset : norm.data_offset + 8] = b"\xff" * 8  # two float32 NaNs
    path = tmp_path / "smollm2.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match=r"1 of \d+ weight tensors hold NaN or inf values") as info:
        load_model(path)
    assert "layers.3.post_attention_layernorm" in str(info.value)


# --------------------------------------------------------------------------- the conversion cache


@pytest.fixture
def conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """The default model's conversion, made fast: a tiny checkpoint stands in for the SmolLM2 GGUF."""
    gguf = tmp_path / "source.gguf"
    gguf.write_bytes(b"GGUF stands in for the bundled file")
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_packaged_file", lambda bundled: gguf)
    state = {"target": tmp_path / "cache" / "models" / models.DEFAULT_MODEL, "conversions": 0, "damage": None}

    def convert(source: Path, out_dir: Path) -> None:
        state["conversions"] += 1
        save_tiny_checkpoint(out_dir)
        if state["damage"] is not None:
            state["damage"](out_dir / "model.safetensors")

    monkeypatch.setattr(models, "_convert_gguf_checkpoint", convert)
    return state


@pytest.mark.parametrize("damage", [truncate, poison])
def test_damaged_conversion_is_rebuilt(conversion: dict, damage, caplog: pytest.LogCaptureFixture) -> None:
    load_model("default")
    damage(conversion["target"] / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="reasonkv.models"):
        model, _ = load_model("default")
    assert conversion["conversions"] == 2
    assert "is damaged" in caplog.text and "converting it again" in caplog.text
    check_finite(model, "the rebuilt copy")
    load_model("default")  # the rebuilt copy is used as it is
    assert conversion["conversions"] == 2
    assert sorted(p.name for p in conversion["target"].parent.iterdir()) == [models.DEFAULT_MODEL]


def test_conversion_damaged_again_says_what_to_delete(conversion: dict) -> None:
    conversion["damage"] = poison  # e.g. a failing disk: every copy written comes back damaged
    with pytest.raises(CorruptModelError, match="damaged again right after converting it") as info:
        load_model("default")
    assert "delete that directory" in str(info.value) and str(conversion["target"]) in str(info.value)
    assert conversion["conversions"] == 2


def test_a_directory_reasonkv_did_not_write_is_left_alone(conversion: dict) -> None:
    target = conversion["target"]
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("the user's own file")
    with pytest.raises(OSError, match="exists but was not written by reasonkv") as info:
        load_model("default")
    assert str(target) in str(info.value) and "REASONKV_CACHE_DIR" in str(info.value)
    assert (target / "notes.txt").read_text() == "the user's own file" and conversion["conversions"] == 0


def test_unwritable_cache_names_the_setting(conversion: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(OSError, match="cannot write the converted smollm2-135m into .*REASONKV_CACHE_DIR"):
        load_model("default")
    assert blocker.read_text() == "not a directory"


# --------------------------------------------------------------------------- hub ids without a hub

OFFLINE_SCRIPT = """
import json, sys, time
from reasonkv.models import load_model
report = {}
start = time.perf_counter()
model, tokenizer = load_model("reasonkv-test-org/cached-model")
report["cached_s"] = time.perf_counter() - start
report["cached_ids"] = tokenizer("the cat sat")["input_ids"]
start = time.perf_counter()
try:
    load_model("reasonkv-test-org/no-such-model")
except OSError as error:
    report["unknown_error"] = str(error)
report["unknown_s"] = time.perf_counter() - start
print(json.dumps(report))
"""


def test_hub_ids_without_a_reachable_hub(tmp_path: Path) -> None:
    """A hub id in the local cache loads, an unknown one fails, both without retrying a hub that is not there."""
    hub_cache = tmp_path / "hub"
    repo = hub_cache / "models--reasonkv-test-org--cached-model"
    commit = "0" * 40
    save_tiny_checkpoint(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_CACHE": str(hub_cache),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing answers there: as on a machine without network
    }
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["cached_ids"] == [3, 4, 5]
    assert "the hub cannot be reached and the local cache does not hold it" in report["unknown_error"]
    # The hub client waits 1 + 2 + 4 + 8 + 8 s between its retries of each file: none may happen. The
    # times are only a loose check, since a busy machine slows the loads themselves.
    assert "Retrying in" not in done.stderr, done.stderr[-3000:]
    assert report["cached_s"] < 60 and report["unknown_s"] < 20, report


def test_check_finite_is_not_fooled_by_an_fp16_sum_that_overflows() -> None:
    model = tiny_llama(dtype=torch.float16)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.fill_(60000.0)  # finite, but its sum overflows fp16
    check_finite(model, "a model with large fp16 weights")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(CorruptModelError, match="up_proj"):
        check_finite(model, "this model")
