"""The rotary embedding as data: read off transformers models, checked against their own rotation, refused by
name when it cannot be undone; and the weights fingerprint."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import HYBRID_MODELS, TINY_MODELS, VOCAB, tiny_llama
from reasonkv.hf import AttentionTap, model_info


def _llama(rope_parameters: dict, head_dim: int = 16) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rope_parameters=rope_parameters,
    )
    return LlamaForCausalLM(config).eval()


SCALED = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
}


def _captured_keys(model, ids):
    """The post-RoPE keys the attention kernel receives in layer 0, and their positions."""
    seen = {}

    def listen(layer, query, key, mask, kwargs):
        seen.setdefault(layer, (query, key))

    tap = AttentionTap(model, listen)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    tap.close()
    return seen[0]


@pytest.mark.parametrize("kind", sorted(SCALED))
def test_scaled_types_are_undone_exactly(kind):
    """The model's own post-RoPE queries, rotated back and forward again by reasonkv's tables, come back."""
    model = _llama(SCALED[kind])
    rotary = model_info(model).rotary[0]
    assert rotary.kind == kind and not rotary.refused and rotary.pairing == "half"
    if kind == "yarn":
        assert rotary.scaling > 1.0  # YaRN folds an attention scaling into cos/sin
    ids = torch.randint(3, VOCAB, (1, 40))
    query, _ = _captured_keys(model, ids)
    positions = torch.arange(40)
    tables = rotary.tables()
    pre = tables.unrotate(query, positions)
    torch.testing.assert_close(tables.rotate(pre, positions), query, rtol=1e-5, atol=1e-5)
    # the pre-RoPE query is position-free: q_proj of the hidden state, the same at every position for one token
    same = torch.full((1, 40), 7)
    query, _ = _captured_keys(model, same)
    pre = tables.unrotate(query, positions)
    torch.testing.assert_close(pre[:, :, 1:], pre[:, :, :1].expand_as(pre[:, :, 1:]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_types_that_depend_on_the_length_are_refused_by_name(kind):
    parameters = {"rope_type": kind, "rope_theta": 10000.0, "factor": 4.0}
    if kind == "longrope":
        parameters = {**parameters, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
        parameters["original_max_position_embeddings"] = 256
    rotary = model_info(_llama(parameters)).rotary[0]
    assert f"'{kind}'" in rotary.refused
    with pytest.raises(ValueError, match=f"triattention: cannot rotate keys back .*'{kind}'"):
        model_info(_llama(parameters)).rotary_of(0, "triattention")


@pytest.mark.parametrize("name", sorted({**TINY_MODELS, **HYBRID_MODELS}))
def test_every_test_architecture_has_an_invertible_rotation_on_its_attention_layers(name):
    model = {**TINY_MODELS, **HYBRID_MODELS}[name]()
    info = model_info(model)
    for layer in info.full_layers:
        assert info.rotary_of(layer, "test").kind == "default"
    if name == "qwen3-next":  # partial rotary: a quarter of the channels rotate
        assert info.rotary[info.full_layers[0]].rotary_dim == info.head_dim // 4


def test_fingerprint_follows_the_weights_not_the_dtype():
    model = tiny_llama()
    fingerprint = model_info(model).fingerprint
    assert len(fingerprint) == 32 and fingerprint == model_info(tiny_llama()).fingerprint
    assert model_info(tiny_llama(dtype=torch.bfloat16)).fingerprint == fingerprint
    assert model_info(tiny_llama(seed=1)).fingerprint != fingerprint
    assert model_info(model.config).fingerprint == "" and model_info(model.config).rotary == ()


def test_a_model_on_the_meta_device_has_no_fingerprint_and_refuses_its_rotation():
    with torch.device("meta"):
        model = _llama({"rope_type": "default", "rope_theta": 10000.0})
    info = model_info(model)
    assert info.fingerprint == ""
    with pytest.raises(ValueError, match="meta device"):
        info.rotary_of(0, "triattention")
