"""Hybrid models: full-attention layers evict, sliding-window layers keep their model's window,
linear-attention layers keep their recurrent state; the oracle holds for every policy."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import HYBRID_MODELS, WINDOW, NoEosTokenizer, tiny_gemma3, tiny_gpt_oss, tiny_mistral
from oracle import run_and_check
from reasonkv import EvictingCache
from reasonkv.policies import policy_class

EVICTING = [name for name in reasonkv.list_policies() if policy_class(name).evicts]
PROMPT = [5 + (7 * i) % 80 for i in range(23)]
PROMPTS = ["A somewhat longer first prompt, to be padded against the others.", "Short.", "Middle length one."]
# Small enough to evict several times in a short run, large enough for every policy's protection.
SMALL = {"snapkv": dict(window=4, query_window=4), "vase-attnv": dict(window=4, query_window=4)}


@pytest.mark.parametrize("model_name", sorted(HYBRID_MODELS))
@pytest.mark.parametrize("policy", EVICTING)
def test_oracle_on_hybrid_models(model_name, policy, one_torch_thread):
    model = HYBRID_MODELS[model_name]()
    prompt = PROMPT[:8] if policy_class(policy).protect_prompt else PROMPT  # a protected prompt must fit K
    cache = run_and_check(model, policy, prompt, budget=12, buffer=5, steps=24, seed=1, **SMALL.get(policy, {}))
    assert cache.evictions >= 3


@pytest.mark.parametrize("model_name", sorted(HYBRID_MODELS))
@pytest.mark.parametrize("policy", EVICTING)
def test_hybrid_batch_equals_each_alone(model_name, policy, one_torch_thread):
    model, tokenizer = HYBRID_MODELS[model_name](), NoEosTokenizer()
    options = {"protect_prompt": False} if policy_class(policy).protect_prompt else {}  # prompts exceed K
    if policy_class(policy).options().get("window", 0) > 4:
        options["window"] = 4
    kw = dict(policy=policy, budget=16, buffer=4, max_new_tokens=20, seed=7, **options)
    together = reasonkv.generate(model, tokenizer, PROMPTS, **kw)
    assert max(r.stats["evictions"] for r in together) >= 2
    for prompt, result in zip(PROMPTS, together, strict=True):
        [alone] = reasonkv.generate(model, tokenizer, prompt, **kw)
        assert result.token_ids == alone.token_ids, (model_name, policy)
