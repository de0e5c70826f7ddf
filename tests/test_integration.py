"""End to end on the bundled SmolLM2-135M-Instruct."""

from __future__ import annotations

import json

import pytest

import reasonkv
from reasonkv.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_streaming_holds_the_budget_for_200_tokens(smollm2):
    model, tokenizer = smollm2
    budget, buffer = 64, 16
    slots = []
    [result] = reasonkv.generate(
        model,
        tokenizer,
        _chat(tokenizer, "Explain step by step how to compute 12 * 34."),
        policy="streaming",
        budget=budget,
        buffer=buffer,
        max_new_tokens=200,
        ignore_eos=True,
        on_step=lambda step, cache: slots.append(cache.slots),
    )
    assert result.num_tokens == 200 and result.text.strip()
    assert max(slots) <= budget + buffer
    processed = result.prompt_tokens + 199  # the last sampled token is never fed back
    assert result.stats["evictions"] == (processed - (budget + buffer)) // buffer + 1
    assert result.stats["peak_slots"] <= max(budget + buffer, result.prompt_tokens)


def test_demo_runs(capsys):
    assert main(["demo", "--max-new-tokens", "40", "--budget", "32", "--buffer", "8"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "full:" in out and "h2o:" in out and "cache slots over decode steps" in out
    assert "policy h2o (the default: the closest to the full cache on the bundled models in docs/results" in out
    # not a terminal: no per-token bar and no "Loading weights" bar in what a log would keep
    assert "decode" not in captured.err and "Loading weights" not in captured.err and "it/s" not in captured.err


def test_generate_command_with_a_quantized_tier(capsys):
    args = ["generate", "--prompt", "Count from one to twenty in words.", "--policy", "h2o", "--budget", "24"]
    # a tier holds at least one key group: head_dim (64) tokens on SmolLM2
    args += ["--buffer", "8", "--quantized", "64", "--bits", "4", "--max-new-tokens", "60", "--json"]
    assert main(args) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])["stats"]
    assert stats["quantized"] == 64 and stats["bits"] == 4 and stats["evictions"] > 0
    assert stats["peak_kv_bytes_by_tier"]["quantized"] > 0
    assert main([*args[:-1], "--policy", "full"]) == 2  # full does not rank tokens
    assert "policy 'full' does not rank tokens" in capsys.readouterr().err


def test_generate_command(capsys):
    # `temperature` is both a sampling argument and a VASE option: the option must reach the policy
    args = ["generate", "--prompt", "What is 2 + 3?", "--policy", "vase-attnv", "--budget", "24", "--buffer", "8"]
    args += ["--max-new-tokens", "30", "--json", "-o", "sinks=2", "-o", "window=4", "-o", "temperature=0.5"]
    assert main(args) == 0
    assert '"policy": "vase-attnv"' in capsys.readouterr().out
