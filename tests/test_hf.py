"""The transformers seam: model facts, layer kinds, the forward helper and the attention tap."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import reasonkv
from conftest import tiny_llama, tiny_qwen3
from reasonkv import hf


def test_model_info_on_configs() -> None:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    llama = LlamaConfig(num_hidden_layers=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    info = hf.model_info(llama)
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (3, 6, 2, 16)
    assert info.layer_kinds == ("full",) * 3
    mha = SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    assert (hf.model_info(mha).num_kv_heads, hf.model_info(mha).head_dim) == (4, 16)  # no GQA fields, no head_dim
    assert (
        hf.model_info(
            SimpleNamespace(num_hidden_layers=1, head_dim=None, hidden_size=64, num_attention_heads=2)
        ).head_dim
        == 32
    )

    assert hf.layer_kinds(MistralConfig(num_hidden_layers=4, sliding_window=4096)) == ("sliding",) * 4
    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=512, max_window_layers=2)
    assert hf.layer_kinds(qwen2) == ("full", "full", "sliding", "sliding")
    assert hf.layer_kinds(Qwen2Config(num_hidden_layers=4, use_sliding_window=False)) == ("full",) * 4
    off = SimpleNamespace(num_hidden_layers=4, sliding_window=4096, use_sliding_window=False)
    assert hf.layer_kinds(off) == ("full",) * 4
    legacy = SimpleNamespace(num_hidden_layers=4, sliding_window=256, use_sliding_window=True, max_window_layers=1)
    assert hf.layer_kinds(legacy) == ("full", "sliding", "sliding", "sliding")


def test_layer_kinds_from_layer_types() -> None:
    from transformers import Gemma3TextConfig, Qwen3NextConfig

    gemma = Gemma3TextConfig(num_hidden_layers=12, sliding_window=512)
    assert hf.layer_kinds(gemma) == tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(12))
    assert hf.sliding_window(gemma) == 512
    qwen_next = Qwen3NextConfig(num_hidden_layers=8)
    assert hf.layer_kinds(qwen_next) == tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(8))


def test_unknown_layer_type_is_refused_naming_type_and_index() -> None:
    config = SimpleNamespace(num_hidden_layers=3, layer_types=["full_attention", "full_attention", "moe"])
    with pytest.raises(ValueError, match=r"layer 2 has type 'moe'"):
        hf.layer_kinds(config)


def test_forward_helper_knows_the_cache_keyword_and_logits_to_keep() -> None:
    model = tiny_llama()
    forward = hf.Forward(model)
    assert forward.cache_key == hf.cache_keyword(model)
    ids, mask = hf.left_pad([[5, 6, 7], [8]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with torch.inference_mode():
        last = forward(ids, hf.plain_cache(), attention_mask=mask, last_logits_only=True).logits
        every = forward(ids, hf.plain_cache(), attention_mask=mask).logits
    assert last.shape[1] == 1 and every.shape[1] == 3
    torch.testing.assert_close(last[:, 0], every[:, -1])


@pytest.fixture
def unwrapped_registry() -> None:
    """Free the taps of models earlier tests left to the garbage collector (a compiled step's capture taps its
    model for the model's life), so that the registry holds the original kernels."""
    import gc

    gc.collect()


@pytest.mark.usefixtures("unwrapped_registry")
def test_tap_sees_post_rope_queries_and_restores_the_registry() -> None:
    model = tiny_llama()
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    seen = []

    def listener(layer, query, key, mask, kwargs):
        seen.append((layer, query.shape, key.shape, kwargs.get("scaling")))

    with torch.inference_mode(), hf.AttentionTap(model, listener) as tap:
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not before  # wrapped while open
        model(torch.tensor([[3, 4, 5, 6]]))
        second = hf.AttentionTap(model, listener)  # a second tap on the same kernel name
        tap.close()
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not before  # still one open tap
        second.close()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before  # exactly the original again
    assert [s[0] for s in seen] == [0, 1, 2]
    assert seen[0][1] == (1, 4, 4, 16) and seen[0][2] == (1, 2, 4, 16) and seen[0][3] == pytest.approx(0.25)
    assert hf.attention_implementation(model) == "sdpa"


@pytest.mark.usefixtures("unwrapped_registry")
def test_tap_released_when_garbage_collected() -> None:
    import gc

    model = tiny_llama()
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    tap = hf.AttentionTap(model, lambda *args: None)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not before
    del tap
    gc.collect()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


@pytest.mark.usefixtures("unwrapped_registry")
def test_a_kernel_registered_over_the_tap_is_kept() -> None:
    model = tiny_llama()
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def theirs(*args, **kwargs):
        return before(*args, **kwargs)

    tap = hf.AttentionTap(model, lambda *args: None)
    AttentionInterface.register("sdpa", theirs)
    try:
        tap.close()
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is theirs
    finally:
        AttentionInterface.register("sdpa", before)


@pytest.mark.usefixtures("unwrapped_registry")
def test_cache_leaves_the_model_and_the_registry_as_it_found_them() -> None:
    model = tiny_qwen3()
    before = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS}
    with torch.inference_mode(), reasonkv.EvictingCache(8, 4, model=model, policy="h2o") as cache:
        model(torch.tensor([[3 + i for i in range(20)]]), **{hf.cache_keyword(model): cache})
    assert {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS} == before
    assert hf.attention_implementation(model) == "sdpa"
    assert not any(hasattr(m, "_reasonkv_tap") for m in model.modules())


_SECOND_MODEL = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, "tests")
    from conftest import tiny_qwen3
    model = tiny_qwen3(seed=3)
    with torch.inference_mode():
        logits = model(torch.tensor([[7 + i % 50 for i in range(40)]])).logits
    torch.save(logits, sys.argv[1])
    """
)


def test_a_tapped_model_never_changes_another_models_logits(tmp_path) -> None:
    """A second model run while the first has an attention-reading cache attached gives bit-identical
    logits to the same model in a fresh process."""
    path = tmp_path / "fresh.pt"
    subprocess.run([sys.executable, "-c", _SECOND_MODEL, str(path)], check=True, cwd=_repo_root())
    fresh = torch.load(path)
    tapped, other = tiny_llama(), tiny_qwen3(seed=3)
    ids = torch.tensor([[7 + i % 50 for i in range(40)]])
    with torch.inference_mode(), reasonkv.EvictingCache(8, 4, model=tapped, policy="tova") as cache:
        tapped(torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]), **{hf.cache_keyword(tapped): cache})
        during = other(ids).logits
    with torch.inference_mode():
        after = other(ids).logits
    assert torch.equal(during, fresh) and torch.equal(after, fresh)


def _repo_root():
    from pathlib import Path

    return Path(__file__).resolve().parents[1]
