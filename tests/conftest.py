"""Tiny random models and a character tokenizer, built in-process (no hub)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 96


def tiny_llama(kv_heads: int = 2, heads: int = 4, layers: int = 3, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_qwen3(kv_heads: int = 2, heads: int = 4, layers: int = 3, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).to(dtype).eval()


# name -> factory: GQA, MHA and MQA on two architectures
TINY_MODELS = {
    "llama-gqa": lambda **kw: tiny_llama(kv_heads=2, **kw),
    "llama-mha": lambda **kw: tiny_llama(kv_heads=4, **kw),
    "llama-mqa": lambda **kw: tiny_llama(kv_heads=1, **kw),
    "qwen3-gqa": lambda **kw: tiny_qwen3(kv_heads=2, **kw),
}


class CharTokenizer:
    """Maps characters to ids 3..95; 0 = pad, 1 = bos, 2 = eos."""

    pad_token_id = 0
    bos_token = None
    eos_token_id = 2
    pad_token = "<pad>"

    def __call__(self, text: str, add_special_tokens: bool = True):
        return {"input_ids": [3 + (ord(c) - 32) % (VOCAB - 3) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i - 3) % (VOCAB - 3)) for i in ids if i >= 3)


class NoEosTokenizer(CharTokenizer):
    eos_token_id = None


@pytest.fixture
def one_torch_thread():
    """Run a test on one torch thread: the tiny models are far faster so, above all on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tokenizer():
    return NoEosTokenizer()


@pytest.fixture(params=sorted(TINY_MODELS))
def any_model(request):
    return TINY_MODELS[request.param]()


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct (converted once into the user cache), fp32 on CPU."""
    from reasonkv.models import load_model

    return load_model("smollm2-135m")
