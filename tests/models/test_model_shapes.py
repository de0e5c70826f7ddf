"""Random-weight shapes: their configs match the published models, they build, and their weights are seeded."""

from __future__ import annotations

import json

import pytest
import torch

from reasonkv.hf import model_info, sliding_window
from reasonkv.models import list_shapes, load_model, random_model, shape_config
from reasonkv.models.shapes import SHAPES_DIR

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
    paths = sorted(SHAPES_DIR.glob("*.json"))
    assert paths, f"no shape files in {SHAPES_DIR}"
    for path in paths:
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


def test_unknown_shape_lists_shapes() -> None:
    with pytest.raises(ValueError, match="Unknown shape 'llama-9000'") as info:
        load_model("shape:llama-9000")
    for name in ("llama-3.1-8b", "qwen3-4b", "tiny"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="Unknown shape"):
        random_model("../shape_configs/tiny")  # a path to a real shape file: names only
