"""KV byte accounting against the formula, memory sizes, the max-batch arithmetic."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import TINY_MODELS, tiny_llama
from reasonkv.bench import maxbatch
from reasonkv.bench.maxbatch import kv_tokens_per_row, measure_max_batch
from reasonkv.bench.memory import MemoryModel, format_bytes, kv_bytes_per_token, parse_bytes, weight_bytes
from reasonkv.cache import CacheSpec
from reasonkv.models import shape_config

GIB = 1024**3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Per-token K+V bytes of one row, worked out by hand from the published configs:
# layers x 2 x kv_heads x head_dim x bytes.
@pytest.mark.parametrize(
    "shape, dtype, expected",
    [
        ("llama-3.1-8b", torch.bfloat16, 32 * 2 * 8 * 128 * 2),  # 131072: the familiar 128 KiB per token
        ("r1-distill-llama-8b", torch.float32, 32 * 2 * 8 * 128 * 4),
        ("qwen3-4b", torch.bfloat16, 36 * 2 * 8 * 128 * 2),
        ("qwen3-14b", torch.float16, 40 * 2 * 8 * 128 * 2),
        ("smollm2-135m-shape", torch.bfloat16, 30 * 2 * 3 * 64 * 2),
        ("tiny", torch.float32, 4 * 2 * 2 * 32 * 4),
    ],
)
def test_kv_bytes_per_token_of_the_shapes(shape, dtype, expected):
    assert kv_bytes_per_token(shape_config(shape), dtype) == expected


@pytest.mark.parametrize("model_name", sorted(TINY_MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_holds_exactly_the_formula(model_name, dtype):
    model = TINY_MODELS[model_name](dtype=dtype)
    config = model.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads
    per_token *= getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token *= torch.empty((), dtype=dtype).element_size()
    assert kv_bytes_per_token(config, dtype) == per_token

    budget, buffer, batch = 12, 6, 2
    held = []
    reasonkv.generate(
        model,
        None,
        [[5 + i for i in range(8)], [9 + i for i in range(8)]],
        policy="streaming",
        budget=budget,
        buffer=buffer,
        max_new_tokens=40,
        ignore_eos=True,
        on_step=lambda step, cache: held.append(cache.kv_bytes()),
    )
    assert max(held) == (budget + buffer) * per_token * batch

    full = []
    reasonkv.generate(
        model,
        None,
        [[5] * 8],
        max_new_tokens=25,
        ignore_eos=True,
        on_step=lambda step, cache: full.append((cache.slots, cache.kv_bytes())),
    )
    # generate reserves the run's longest row (prompt + new tokens): the full cache allocates once.
    assert {kv for _, kv in full} == {(8 + 25) * per_token}
    assert max(slots for slots, _ in full) == 8 + 25 - 1  # the last sampled token is never fed


def test_weight_bytes_counts_tied_weights_once():
    model = tiny_llama()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert weight_bytes(model) == params + buffers
    model.lm_head.weight = model.model.embed_tokens.weight
    assert weight_bytes(model) == params + buffers - model.lm_head.weight.numel() * 4


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * GIB),
        ("48GB", 48 * 10**9),
        ("512MiB", 512 * 1024**2),
        ("1.5TiB", int(1.5 * 1024**4)),
        ("1000", 1000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12XB", "-3GiB", "0"])
def test_parse_bytes_errors(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(None) == "-"
    assert format_bytes(3 * 1024**2) == "3.0 MiB"
    assert format_bytes(3 * GIB) == "3.00 GiB"


def test_memory_model_max_batch():
    model = MemoryModel(fixed=10 * GIB, kv_row=2 * GIB, other_row=0.5 * GIB)
    assert model.per_row == 2.5 * GIB
    assert model.max_batch(24 * GIB) == 5  # (24 - 10) / 2.5 = 5.6
    assert model.max_batch(22.5 * GIB) == 5  # exactly on the boundary
    assert model.max_batch(22.5 * GIB - 1) == 4
    assert model.max_batch(11 * GIB) == 0
    assert model.required(5) == 22.5 * GIB
    with pytest.raises(ValueError, match="positive"):
        MemoryModel(fixed=0, kv_row=0, other_row=0).max_batch(GIB)


def test_memory_model_fit_recovers_a_synthetic_machine():
    fixed, kv_alloc, other = 5e9, 3e8, 2e7

    def probe(batch):
        return {"batch": batch, "peak_bytes": fixed + batch * (kv_alloc + other), "kv_bytes": batch * kv_alloc}

    model = MemoryModel.fit([probe(1), probe(4)], kv_row=2.5e8)
    assert model.fixed == pytest.approx(fixed)
    assert model.other_row == pytest.approx(other)
    assert model.kv_row == 2.5e8  # the formula replaces what the cache allocated
    assert model.max_batch(fixed + 10 * (2.5e8 + other)) == 10
    with pytest.raises(ValueError, match="two different batch sizes"):
        MemoryModel.fit([probe(2), probe(2)], kv_row=1.0)


def test_kv_tokens_per_row():
    assert kv_tokens_per_row(CacheSpec.build("full", 4096, 128), 16384) == 16384  # the full cache keeps all
    assert kv_tokens_per_row(CacheSpec.build("streaming", 4096, 128), 16384) == 4224
    assert kv_tokens_per_row(CacheSpec.build("streaming", 4096, 128), 1000) == 1000


def test_max_batch_on_a_synthetic_memory_model(monkeypatch):
    """The probes see ``fixed + b x (kv + other)``; the machine holds 6 rows; batches above run out of memory."""
    model = tiny_llama()
    per_token = kv_bytes_per_token(model.config, torch.float32)
    fixed, other, length = 1_000_000, 50_000, 64
    kv_row = length * per_token  # the full cache holds every token
    calls = []

    def fake(model, spec, *, batch, decode_steps, **kwargs):
        calls.append(batch)
        if batch > 5:
            raise torch.OutOfMemoryError("CUDA out of memory (synthetic)")
        return {
            "peak_memory_bytes": fixed + batch * (kv_row + other),
            "kv_bytes": batch * kv_row,
            "step_mean_s": 0.01,
            "tokens_per_s": batch / 0.01,
            "step_s": [0.01],
        }

    monkeypatch.setattr(maxbatch, "measure_prefilled", fake)
    monkeypatch.setattr(maxbatch, "free_memory", lambda device: None)
    monkeypatch.setattr(maxbatch, "machine_memory_bytes", lambda device: 10**12)
    limit = fixed + 12 * (kv_row + other) + 10
    result = measure_max_batch(
        model,
        CacheSpec.build("full", 16, 8),
        length=length,
        memory_limit=limit,
        decode_steps=4,
        probe_batches=(1, 3),
    )
    assert result["memory_model"]["other_row"] == pytest.approx(other)
    assert result["memory_model"]["fixed"] == pytest.approx(fixed)
    assert result["max_batch"] == 12
    # 12 and 6 run out of memory, 3 fits
    assert calls == [1, 3, 12, 6, 3]
    assert result["measured_batch"] == 3
    assert [a["batch"] for a in result["attempts"]] == [12, 6]
    assert result["tokens_per_s"] == pytest.approx(300)
    assert any("halved" in note for note in result["notes"])

    # An evicting policy: KV per row is K + B tokens, so more rows fit; the cap is reported.
    calls.clear()
    monkeypatch.setattr(
        maxbatch,
        "measure_prefilled",
        lambda model, spec, *, batch, **kw: {
            "peak_memory_bytes": fixed + batch * (24 * per_token + other),
            "kv_bytes": batch * 24 * per_token,
            "step_mean_s": 0.01,
            "tokens_per_s": batch / 0.01,
        },
    )
    result = measure_max_batch(
        model,
        CacheSpec.build("streaming", 16, 8),
        length=length,
        memory_limit=limit,
        decode_steps=4,
        max_measured_batch=7,
    )
    assert result["max_batch"] == (limit - fixed) // (24 * per_token + other)
    assert result["measured_batch"] == 7
    assert "--max-measured-batch" in result["notes"][0]
