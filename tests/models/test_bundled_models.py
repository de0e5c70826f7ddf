"""The bundled models: a missing package names its install command; the conversion into the user cache is
atomic, rebuilt when outdated or damaged, and never touches a directory it did not write; the converted
SmolLM2 loads and matches its GGUF file."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import poison, save_tiny_checkpoint, truncate
from reasonkv.hf import model_info
from reasonkv.models import (
    DEFAULT_MODEL,
    SMOLLM2_INSTALL_COMMAND,
    SMOLLM2_PACKAGE,
    bundled,
    cache_dir,
    files,
    load_model,
)
from reasonkv.models.files import CorruptModelError, check_finite

HAS_SMOLLM2 = importlib.util.find_spec(SMOLLM2_PACKAGE) is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs `{SMOLLM2_INSTALL_COMMAND}`")


# --------------------------------------------------------------------------- a missing package


def test_missing_default_package_gives_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == SMOLLM2_PACKAGE else real_find_spec(name, *a),
    )
    for name in ("smollm2-135m", "default"):
        with pytest.raises(ImportError) as info:
            load_model(name)
        assert SMOLLM2_INSTALL_COMMAND in str(info.value)


# --------------------------------------------------------------------------- cache directory


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("REASONKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "reasonkv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "reasonkv"
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"


@needs_smollm2
def test_failed_conversion_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(tmp_path))

    def half_written(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the user stopped the conversion half way

    monkeypatch.setattr(bundled, "_convert_gguf_checkpoint", half_written)
    with pytest.raises(KeyboardInterrupt):
        load_model("default")
    assert list((tmp_path / "models").iterdir()) == []


@needs_smollm2
def test_outdated_cache_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / bundled._CONVERSION_MARKER).write_text('{"format": 0}')  # written by an older layout
    calls: list[Path] = []

    def fake_convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text('{"converted": true}')

    monkeypatch.setattr(bundled, "_convert_gguf_checkpoint", fake_convert)
    assert bundled._ensure_converted(bundled.BUNDLED[DEFAULT_MODEL]) == target
    assert bundled._ensure_converted(bundled.BUNDLED[DEFAULT_MODEL]) == target  # second call: valid copy, no conversion
    assert len(calls) == 1
    assert json.loads((target / "config.json").read_text()) == {"converted": True}
    assert sorted(p.name for p in target.parent.iterdir()) == [DEFAULT_MODEL]


# --------------------------------------------------------------------------- the conversion cache


@pytest.fixture
def conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """The default model's conversion, made fast: a tiny checkpoint stands in for the SmolLM2 GGUF."""
    gguf = tmp_path / "source.gguf"
    gguf.write_bytes(b"GGUF stands in for the bundled file")
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bundled, "_packaged_file", lambda model: gguf)
    state = {"target": tmp_path / "cache" / "models" / DEFAULT_MODEL, "conversions": 0, "damage": None}

    def convert(source: Path, out_dir: Path) -> None:
        state["conversions"] += 1
        save_tiny_checkpoint(out_dir)
        if state["damage"] is not None:
            state["damage"](out_dir / "model.safetensors")

    monkeypatch.setattr(bundled, "_convert_gguf_checkpoint", convert)
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
    assert sorted(p.name for p in conversion["target"].parent.iterdir()) == [DEFAULT_MODEL]


def _scramble(path: Path) -> None:
    """Finite garbage in the weights (a bit flipped in every float's mantissa): loads without any error."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")  # safetensors: the JSON header, then the tensors' bytes
    for i in range(header, len(data), 4):
        data[i] ^= 0x10
    path.write_bytes(bytes(data))


def test_finite_garbage_in_the_weights_is_found_by_the_digest_and_the_copy_converted_again(
    conversion: dict, caplog: pytest.LogCaptureFixture
) -> None:
    load_model("default")
    weights = conversion["target"] / "model.safetensors"
    size = weights.stat().st_size
    _scramble(weights)
    assert weights.stat().st_size == size
    damaged = load_directory_unchecked(conversion["target"])
    check_finite(damaged, "the scrambled copy")  # finite: nothing but the digest tells
    with caplog.at_level(logging.WARNING, logger="reasonkv.models"):
        model, _ = load_model("default")
    assert conversion["conversions"] == 2
    assert "model.safetensors was changed after it was written" in caplog.text and "converting it again" in caplog.text
    marker = json.loads((conversion["target"] / bundled._CONVERSION_MARKER).read_text())
    assert marker["files"]["model.safetensors"]["sha256"] == files._sha256(weights)  # the new copy, as written


def test_a_byte_changed_in_place_with_its_old_time_put_back_is_found(
    conversion: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """Size and modification time as recorded: the status-change time, which no program sets back, tells."""
    load_model("default")
    weights = conversion["target"] / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x01  # one bit of the last weight: finite, loads without any error
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with caplog.at_level(logging.WARNING, logger="reasonkv.models"):
        load_model("default")
    assert "model.safetensors was changed after it was written" in caplog.text and conversion["conversions"] == 2


def test_a_copy_touched_but_not_changed_is_hashed_once_and_kept(conversion: dict, monkeypatch) -> None:
    load_model("default")
    weights = conversion["target"] / "model.safetensors"
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # copied with its bytes, a new time
    hashed: list[Path] = []
    real = files._sha256
    monkeypatch.setattr(files, "_sha256", lambda path: hashed.append(path) or real(path))
    load_model("default")
    load_model("default")
    assert hashed == [weights] and conversion["conversions"] == 1  # the second load: a stat per file only


def load_directory_unchecked(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory)


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


# --------------------------------------------------------------------------- the bundled model

PROMPT = [{"role": "user", "content": "What is 12 times 7? Think step by step."}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Convert the bundled model into a fresh cache, reload it, and load the GGUF file as reference."""
    if not HAS_SMOLLM2:
        pytest.skip(f"needs `{SMOLLM2_INSTALL_COMMAND}`")
    root = tmp_path_factory.mktemp("reasonkv-cache")
    out: dict[str, Any] = {"root": root}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REASONKV_CACHE_DIR", str(root))
        start = time.perf_counter()
        model1, tok1 = load_model("smollm2-135m")
        out["first_s"] = time.perf_counter() - start
        out["after_first"] = sorted(p.name for p in (root / "models").iterdir())

        def no_conversion(*args: object) -> None:
            raise AssertionError("the second load must read the converted copy")

        mp.setattr(bundled, "_convert_gguf_checkpoint", no_conversion)
        start = time.perf_counter()
        model, tok = load_model("default")
        out["second_s"] = time.perf_counter() - start

    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    with torch.no_grad():
        out["logits_first"] = model1(ids).logits
        out["logits"] = model(ids).logits
    del model1

    gguf_model, gguf_tok = load_model(bundled.BUNDLED[DEFAULT_MODEL].file())
    with torch.no_grad():
        out["logits_gguf"] = gguf_model(ids).logits
    del gguf_model
    out.update(model=model, tok=tok, tok_first=tok1, gguf_tok=gguf_tok, ids=ids)
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_first_load_converts_into_cache(converted: dict[str, Any]) -> None:
    target = converted["root"] / "models" / DEFAULT_MODEL
    # Only the final directory: no temp dir left behind by the atomic write.
    assert converted["after_first"] == [DEFAULT_MODEL]
    assert (target / "model.safetensors").is_file() and (target / bundled._CONVERSION_MARKER).is_file()
    assert "quantization_config" not in json.loads((target / "config.json").read_text())


@pytest.mark.integration
@pytest.mark.slow
def test_second_load_reads_converted_copy(converted: dict[str, Any]) -> None:
    # The converter is disabled during the second load, so reaching here means it used the copy.
    assert converted["second_s"] < converted["first_s"]


@pytest.mark.integration
@pytest.mark.slow
def test_converted_logits_match_gguf(converted: dict[str, Any]) -> None:
    reference = converted["logits_gguf"]
    assert reference.shape[-1] == 49152 and torch.isfinite(reference).all()
    torch.testing.assert_close(converted["logits"], reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(converted["logits_first"], reference, rtol=0, atol=1e-5)


@pytest.mark.integration
@pytest.mark.slow
def test_bundled_tokenizer(converted: dict[str, Any]) -> None:
    for tok in (converted["tok"], converted["tok_first"], converted["gguf_tok"]):
        assert tok.padding_side == "left"
        assert tok.pad_token == tok.eos_token == "<|im_end|>"
        assert tok.eos_token_id == 2 and tok.bos_token == "<|im_start|>"
        assert tok.chat_template
    assert converted["ids"][0, 0].item() == converted["tok"].convert_tokens_to_ids("<|im_start|>")
    batch = converted["tok"](["hi", "a much longer prompt"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0, 0].item() == 0 and batch["attention_mask"][0, -1].item() == 1


@pytest.mark.integration
@pytest.mark.slow
def test_bundled_architecture(converted: dict[str, Any]) -> None:
    model = converted["model"]
    info = model_info(model)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (30, 3, 64)
    assert set(info.layer_kinds) == {"full"}
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    assert model.generation_config.pad_token_id == 2


@pytest.mark.integration
@pytest.mark.slow
def test_bundled_bf16_eager_from_cache(converted: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(converted["root"]))
    model, _ = load_model("smollm2-135m", dtype="bfloat16", attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        logits = model(converted["ids"]).logits.float()
    # bf16 rounding moves logits a little; the prediction stays among the fp32 model's top choices.
    assert logits[0, -1].argmax().item() in converted["logits"][0, -1].topk(3).indices.tolist()
