"""Helpers of the vLLM integration's tests (not a conftest: tests/conftest.py is one already). They run in
the environment scripts/setup_vllm.sh builds (vLLM's CPU build);
each module skips where vLLM is not installed (``needs_vllm``), so this file imports none of it.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0: a test can read the scheduler and its block pool),
eagerly (no compile: seconds to start), in fp32, on the bundled SmolLM2, fed token ids (the converted
tokenizer maps spaces to <|endoftext|> in recent transformers).
"""

from __future__ import annotations

import functools
import os

import pytest

from reasonkv.models.bundled import BUNDLED, DEFAULT_MODEL, _ensure_converted


def needs_vllm() -> None:
    """Skip the calling test module where vLLM is not installed."""
    # vllm.config, not vllm: where vLLM is missing, `vllm` would import this folder as a namespace package.
    pytest.importorskip("vllm.config", reason="vLLM is not installed (scripts/setup_vllm.sh builds .venv-vllm with it)")


os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# Three ragged prompts: shorter than K + B, longer than it (evicted right after prefill), in between.
PROMPTS = [list(range(100, 126)), list(range(200, 320)), list(range(400, 470))]
BUDGET, BUFFER, BLOCK = 64, 16, 32
NEW_TOKENS = 100


@functools.cache
def model_dir() -> str:
    """The bundled SmolLM2's converted directory (converted on first use)."""
    return str(_ensure_converted(BUNDLED[DEFAULT_MODEL]))


def engine(reasonkv: dict | None = None, **options):
    """An in-process engine on the bundled model, with ``reasonkv`` as its additional_config key (None: none)."""
    from vllm import LLM

    settings = dict(
        dtype="float32",
        block_size=BLOCK,
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        additional_config={} if reasonkv is None else {"reasonkv": reasonkv},
    )
    settings.update(options)
    return LLM(model_dir(), **settings)


def greedy(llm, prompts=PROMPTS, tokens: int = NEW_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def scheduler_of(llm):
    """The engine's scheduler (in-process engines only)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
