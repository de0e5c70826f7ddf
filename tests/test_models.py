"""Tests for reasonkv.models: argument validation, shapes, config helpers and the bundled model."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from reasonkv import models
from reasonkv.hf import model_info, sliding_window
from reasonkv.models import (
    SMOLLM2_INSTALL_COMMAND,
    cache_dir,
    list_shapes,
    load_model,
    random_model,
    shape_config,
)

HAS_SMOLLM2 = importlib.util.find_spec(models.SMOLLM2_PACKAGE) is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs `{SMOLLM2_INSTALL_COMMAND}`")


# --------------------------------------------------------------------------- argument validation


@pytest.mark.parametrize("dtype", ["fp8", "int8", "FP33", torch.int8, None])
def test_bad_dtype_names_value_and_choices(dtype: Any) -> None:
    with pytest.raises(ValueError, match="Unsupported dtype") as info:
        load_model("shape:tiny", dtype=dtype)
    assert repr(dtype) in str(info.value)
    assert "'bf16'" in str(info.value) and "'fp32'" in str(info.value)


@pytest.mark.parametrize(("dtype", "expected"), [("bf16", torch.bfloat16), ("float16", torch.float16)])
def test_dtype_aliases(dtype: str, expected: torch.dtype) -> None:
    assert models.resolve_dtype(dtype) is expected
    assert models.resolve_dtype(expected) is expected


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


def test_unknown_shape_lists_shapes() -> None:
    with pytest.raises(ValueError, match="Unknown shape 'llama-9000'") as info:
        load_model("shape:llama-9000")
    for name in ("llama-3.1-8b", "qwen3-4b", "tiny"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="Unknown shape"):
        random_model("../shapes/tiny")


@pytest.mark.parametrize("name", ["/no/such/checkpoint", "./missing-dir", "~/no-such-reasonkv-model/x"])
def test_missing_local_path(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        load_model(name)
    assert repr(name) in str(info.value)


def test_missing_gguf_file(tmp_path: Path) -> None:
    missing = tmp_path / "model.Q4_0.gguf"
    with pytest.raises(FileNotFoundError, match="GGUF file not found") as info:
        load_model(missing)
    assert str(missing) in str(info.value)


def test_invalid_name() -> None:
    with pytest.raises(ValueError, match="'not a model!'"):
        load_model("not a model!")
    with pytest.raises(ValueError, match="non-empty"):
        load_model("  ")


def test_unresolvable_hub_id_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Offline mode makes the hub lookup fail at once instead of retrying over the network.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    name = "reasonkv-test-org/no-such-model"
    with pytest.raises(OSError, match="Cannot load model") as info:
        load_model(name)
    assert repr(name) in str(info.value)
    assert "shape:<name>" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_missing_default_package_gives_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == models.SMOLLM2_PACKAGE else real_find_spec(name, *a),
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

    monkeypatch.setattr(models, "_convert_gguf_checkpoint", half_written)
    with pytest.raises(KeyboardInterrupt):
        load_model("default")
    assert list((tmp_path / "models").iterdir()) == []


@needs_smollm2
def test_outdated_cache_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / models.DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / models._CONVERSION_MARKER).write_text('{"format": 0}')  # written by an older layout
    calls: list[Path] = []

    def fake_convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text('{"converted": true}')

    monkeypatch.setattr(models, "_convert_gguf_checkpoint", fake_convert)
    assert models._ensure_smollm2_converted() == target
    assert models._ensure_smollm2_converted() == target  # second call: valid copy, no conversion
    assert len(calls) == 1
    assert json.loads((target / "config.json").read_text()) == {"converted": True}
    assert sorted(p.name for p in target.parent.iterdir()) == [models.DEFAULT_MODEL]


# --------------------------------------------------------------------------- shapes

# Values from the published config.json files of the models these shapes stand for.
PUBLISHED = {
    "llama-3.1-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "qwen3-4b": dict(
        num_hidden_layers=36,
        hidden_size=2560,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-14b": dict(
        num_hidden_layers=40,
        hidden_size=5120,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=17408,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "smollm2-135m-shape": dict(
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
}
# Parameter counts (billions) as built, a check on the whole set of dimensions.
PARAMS_B = {
    "llama-3.1-8b": 8.03,
    "qwen3-4b": 4.02,
    "qwen3-14b": 14.77,
    "smollm2-135m-shape": 0.1345,
    "gpt-oss-20b": 20.91,  # published: 20.9B (3.6B active)
    "gemma-3-27b": 27.01,  # the language model of the 27B release (its vision tower is not part of it)
}
# Hybrid shapes: which layer is full attention (the rest slide), and the window.
HYBRID_SHAPES = {
    "gpt-oss-20b": (lambda i: i % 2 == 1, 128),
    "gemma-3-27b": (lambda i: i % 6 == 5, 1024),
    "tiny-hybrid": (lambda i: i % 2 == 1, 16),
}


def test_list_shapes() -> None:
    expected = {"llama-3.1-8b", "r1-distill-llama-8b", "qwen3-4b", "qwen3-14b", "smollm2-135m-shape", "tiny"}
    expected |= {"gpt-oss-20b", "gpt-oss", "gemma-3-27b", "gemma3-27b"}
    assert expected <= set(list_shapes())


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_shape_config_matches_published(shape: str) -> None:
    config = shape_config(shape)
    for field, value in PUBLISHED[shape].items():
        assert getattr(config, field) == value, field


def test_llama_rope_and_alias() -> None:
    config = shape_config("llama-3.1-8b")
    rope = config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["rope_theta"] == 500000.0
    assert shape_config("r1-distill-llama-8b").to_dict() == config.to_dict()
    assert shape_config("qwen3-14b").rope_parameters["rope_theta"] == 1000000


@pytest.mark.parametrize("shape", list_shapes())
def test_every_shape_builds_on_meta(shape: str) -> None:
    eager_only = shape_config(shape).model_type == "gpt_oss"  # GPT-OSS has no SDPA path (its sinks)
    model = random_model(shape, "bf16", "meta", "eager" if eager_only else "sdpa")
    assert not model.training
    params = list(model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    if shape in PARAMS_B:
        assert sum(p.numel() for p in params) / 1e9 == pytest.approx(PARAMS_B[shape], rel=2e-3)
    canonical = shape_config(shape).to_dict()
    hybrid = next((h for name, h in HYBRID_SHAPES.items() if shape_config(name).to_dict() == canonical), None)
    if hybrid is None:
        assert set(model_info(model).layer_kinds) == {"full"}
    else:
        is_full, window = hybrid
        kinds = model_info(model).layer_kinds
        assert kinds == tuple("full" if is_full(i) else "sliding" for i in range(len(kinds)))
        assert sliding_window(model) == window


def test_a_kernel_the_architecture_lacks_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"GptOssForCausalLM does not support attn_implementation='sdpa'; choose"):
        random_model("gpt-oss-20b", "bf16", "meta", "sdpa")


def test_every_shape_json_is_valid() -> None:
    for path in (Path(models.__file__).parent / "shapes").glob("*.json"):
        fields = json.loads(path.read_text())
        assert fields["model_type"] in ("llama", "qwen3", "gpt_oss", "gemma3_text"), path.name


def test_tiny_forward_is_finite() -> None:
    model, tokenizer = load_model("shape:tiny")
    assert tokenizer is None and not model.training
    info = model_info(model)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (4, 2, 32)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 12, 512) and torch.isfinite(logits).all()


def test_random_model_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = random_model("tiny", seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    second = random_model("tiny", seed=7)
    other = random_model("tiny", seed=8)
    weights = [m.model.embed_tokens.weight for m in (first, second, other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_random_model_dtype_and_eager() -> None:
    model = random_model("tiny", "bf16", "cpu", "eager")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


# --------------------------------------------------------------------------- the bundled model

PROMPT = [{"role": "user", "content": "What is 12 times 7? Think step by step."}]


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
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

        mp.setattr(models, "_convert_gguf_checkpoint", no_conversion)
        start = time.perf_counter()
        model, tok = load_model("default")
        out["second_s"] = time.perf_counter() - start

    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    with torch.no_grad():
        out["logits_first"] = model1(ids).logits
        out["logits"] = model(ids).logits
    del model1

    gguf_model, gguf_tok = load_model(models._smollm2_gguf_path())
    with torch.no_grad():
        out["logits_gguf"] = gguf_model(ids).logits
    del gguf_model
    out.update(model=model, tok=tok, tok_first=tok1, gguf_tok=gguf_tok, ids=ids)
    return out


@pytest.mark.integration
def test_first_load_converts_into_cache(bundled: dict[str, Any]) -> None:
    target = bundled["root"] / "models" / models.DEFAULT_MODEL
    # Only the final directory: no temp dir left behind by the atomic write.
    assert bundled["after_first"] == [models.DEFAULT_MODEL]
    assert (target / "model.safetensors").is_file() and (target / models._CONVERSION_MARKER).is_file()
    assert "quantization_config" not in json.loads((target / "config.json").read_text())


@pytest.mark.integration
def test_second_load_reads_converted_copy(bundled: dict[str, Any]) -> None:
    # The converter is disabled during the second load, so reaching here means it used the copy.
    assert bundled["second_s"] < bundled["first_s"]


@pytest.mark.integration
def test_converted_logits_match_gguf(bundled: dict[str, Any]) -> None:
    reference = bundled["logits_gguf"]
    assert reference.shape[-1] == 49152 and torch.isfinite(reference).all()
    torch.testing.assert_close(bundled["logits"], reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(bundled["logits_first"], reference, rtol=0, atol=1e-5)


@pytest.mark.integration
def test_bundled_tokenizer(bundled: dict[str, Any]) -> None:
    for tok in (bundled["tok"], bundled["tok_first"], bundled["gguf_tok"]):
        assert tok.padding_side == "left"
        assert tok.pad_token == tok.eos_token == "<|im_end|>"
        assert tok.eos_token_id == 2 and tok.bos_token == "<|im_start|>"
        assert tok.chat_template
    assert bundled["ids"][0, 0].item() == bundled["tok"].convert_tokens_to_ids("<|im_start|>")
    batch = bundled["tok"](["hi", "a much longer prompt"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0, 0].item() == 0 and batch["attention_mask"][0, -1].item() == 1


@pytest.mark.integration
def test_bundled_architecture(bundled: dict[str, Any]) -> None:
    model = bundled["model"]
    info = model_info(model)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (30, 3, 64)
    assert set(info.layer_kinds) == {"full"}
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    assert model.generation_config.pad_token_id == 2


@pytest.mark.integration
def test_bundled_bf16_eager_from_cache(bundled: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REASONKV_CACHE_DIR", str(bundled["root"]))
    model, _ = load_model("smollm2-135m", dtype="bfloat16", attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        logits = model(bundled["ids"]).logits.float()
    # bf16 rounding moves logits a little; the prediction stays among the fp32 model's top choices.
    assert logits[0, -1].argmax().item() in bundled["logits"][0, -1].topk(3).indices.tolist()
