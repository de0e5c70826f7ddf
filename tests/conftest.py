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


def _tiny(config, cls, attn: str, dtype, seed: int):
    torch.manual_seed(seed)
    config._attn_implementation = attn
    model = cls(config).eval()
    with torch.no_grad():  # norms initialised to one scale every key alike: make key norms differ
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.to(dtype)


SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    pad_token_id=0,
    eos_token_id=None,
    bos_token_id=None,
)
WINDOW = 6  # the tiny hybrid models' sliding window: shorter than the tests' prompts and budgets


def tiny_gemma3(dtype=torch.float32, seed: int = 0, softcap: float | None = None):
    """Gemma 3 style: sliding-window and full-attention layers (sliding first), per-kind RoPE."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = Gemma3TextConfig(
        **SHARED,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=layer_types,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=softcap,
    )
    return _tiny(config, Gemma3ForCausalLM, "sdpa", dtype, seed)


def tiny_gpt_oss(dtype=torch.float32, seed: int = 0):
    """GPT-OSS style: alternating sliding/full layers with learned attention sinks (eager only), MoE."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **SHARED,
        intermediate_size=64,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = _tiny(config, GptOssForCausalLM, "eager", dtype, seed)
    with torch.no_grad():  # sinks strong enough to matter (the default init leaves them near 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(2.0 * torch.randn_like(layer.self_attn.sinks))
    return model


def tiny_qwen3_next(dtype=torch.float32, seed: int = 0):
    """Qwen3-Next style: linear-attention (gated delta rule, recurrent state) and full-attention layers."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **SHARED,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    return _tiny(config, Qwen3NextForCausalLM, "sdpa", dtype, seed)


def tiny_mistral(dtype=torch.float32, seed: int = 0):
    """Mistral style: every layer slides (nothing to evict)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SHARED, intermediate_size=128, num_hidden_layers=2, sliding_window=WINDOW)
    return _tiny(config, MistralForCausalLM, "sdpa", dtype, seed)


# name -> factory: models whose layers are not all full attention
HYBRID_MODELS = {"gemma3": tiny_gemma3, "gpt-oss": tiny_gpt_oss, "qwen3-next": tiny_qwen3_next}

# name -> factory: GQA, MHA and MQA on two architectures
TINY_MODELS = {
    "llama-gqa": lambda **kw: tiny_llama(kv_heads=2, **kw),
    "llama-mha": lambda **kw: tiny_llama(kv_heads=4, **kw),
    "llama-mqa": lambda **kw: tiny_llama(kv_heads=1, **kw),
    "qwen3-gqa": lambda **kw: tiny_qwen3(kv_heads=2, **kw),
}


# Policies whose cases of a per-policy pattern run in the default tier, one of each kind of machinery:
# token-level and attention-free (streaming), head-level over accumulated attention (h2o), over a window
# of recent queries and stochastic (vase-attnv), token-level over the residual stream (epikv).
FAST_POLICIES = ("streaming", "h2o", "vase-attnv", "epikv")


def fast_few(values, fast=FAST_POLICIES):
    """``values`` as parametrize cases with those not in ``fast`` marked slow: the default run keeps a
    few representative cases of a pattern, the slow tier (``-m slow``, run by CI) the rest."""
    values = list(values)
    if not set(fast) & set(values):
        raise ValueError(f"none of the fast cases {sorted(fast)} is among the values {values}")
    return [value if value in fast else pytest.param(value, marks=pytest.mark.slow) for value in values]


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
