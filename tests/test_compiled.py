"""Compiled decode: every policy decodes the same tokens compiled as eager, the oracle holds in the fixed-shape
layout, a run that evicts hundreds of times compiles once per (batch size, capacity), and what cannot be
compiled says so and runs eager.

Most tests trace with ``aot_eager`` (dynamo's graph capture and functionalization, no code generation: what
a wrong static layout or a hook that does not run inside the graph breaks); one runs inductor itself.
"""

from __future__ import annotations

import gc

import pytest
import torch

import reasonkv
import reasonkv.generation.loop
from conftest import fast_few, tiny_gemma3, tiny_llama
from oracle import run_and_check
from reasonkv.cli.main import main
from reasonkv.generation.compiled import CompiledDecode
from reasonkv.policies import policy_class

pytestmark = pytest.mark.filterwarnings("ignore:triattention. query centers:UserWarning")

# Selection policies refuse compiled decode (tests/selection checks the refusal).
POLICIES = [name for name in reasonkv.list_policies() if not policy_class(name).selects]
EVICTING = [name for name in POLICIES if policy_class(name).evicts]
# Prompts of three lengths: a ragged batch whose rows evict at different steps.
PROMPTS = [[3 + (5 * i + 7 * r) % 90 for i in range(n)] for r, n in enumerate((31, 12, 47))]
ORACLE_PROMPT = [5 + (7 * i) % 80 for i in range(23)]


def _options(policy: str) -> dict:
    """Settings that let every policy evict every few steps at K = 16."""
    options = policy_class(policy).options()
    small = {}
    for name, value in {"window": 4, "query_window": 4, "sinks": 2}.items():
        if name in options and isinstance(options[name], int) and options[name] > value:
            small[name] = value
    if options.get("protect_prompt"):
        small["protect_prompt"] = False  # the prompts exceed K
    return small


def _generate(model, policy: str, compile=False, **kw):
    settings = dict(policy=policy, budget=16, buffer=4, max_new_tokens=64, ignore_eos=True, seed=[1, 2, 3])
    settings.update(_options(policy), **kw)
    return reasonkv.generate(model, None, PROMPTS, compile=compile, **settings)


@pytest.fixture(scope="module")
def deep_llama():
    return tiny_llama(layers=6)


@pytest.mark.parametrize("policy", fast_few(POLICIES, fast=("streaming",)))
def test_every_policy_decodes_the_same_tokens_compiled_as_eager_in_fp32(deep_llama, policy):
    eager = _generate(deep_llama, policy)
    compiled = _generate(deep_llama, policy, compile="aot_eager")
    assert [r.token_ids for r in compiled] == [r.token_ids for r in eager]
    assert [r.stats["evictions"] for r in compiled] == [r.stats["evictions"] for r in eager]
    ran = compiled[0].stats["compile"]
    assert ran["compiled"] and ran["eager_reason"] is None and ran["backend"] == "aot_eager"
    if policy_class(policy).evicts:
        assert min(r.stats["evictions"] for r in compiled) >= 8  # many evictions, in every row
    # The fixed-shape layout is the eager cache's own buffers: no more K/V held or allocated.
    for key in ("peak_kv_bytes", "peak_kv_bytes_allocated", "peak_slots"):
        assert compiled[0].stats[key] == eager[0].stats[key], key


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "streaming", "h2o", "snapkv", "epikv", "vase-attnv", "tova", "rkv"])
def test_in_bf16_a_lone_row_decodes_the_same_tokens_compiled_as_eager_up_to_a_near_tie(policy):
    """The fixed-shape layout attends over a padded buffer: the CPU's bf16 kernels may sum its blocks in
    another order than the eager cache's (this differs between CPUs), which moves a logit by a rounding step.
    So the tokens must agree until the eager decode meets a near-tie (its top two logits within a few bf16
    steps), and a divergence must happen at one, never where the choice was clear."""
    model = tiny_llama(layers=6, dtype=torch.bfloat16)
    settings = dict(policy=policy, budget=16, buffer=4, max_new_tokens=64, ignore_eos=True, **_options(policy))
    ties = []  # per decoded token: was the eager choice a near-tie?

    def note_tie(module, args, logits):
        top = logits[0, -1].float().topk(2).values
        step = 2.0 ** (torch.floor(torch.log2(top[0].abs().clamp_min(1e-6))) - 7)  # bf16's rounding step there
        ties.append(bool(top[0] - top[1] <= 4 * step))

    hook = model.get_output_embeddings().register_forward_hook(note_tie)
    try:
        eager = reasonkv.generate(model, None, [PROMPTS[0]], **settings)
    finally:
        hook.remove()
    compiled = reasonkv.generate(model, None, [PROMPTS[0]], compile="aot_eager", **settings)
    ours, theirs = compiled[0].token_ids, eager[0].token_ids
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    assert first is None or ties[first], f"compiled and eager part at token {first}, where eager's choice was clear"
    assert compiled[0].stats["evictions"] >= 8 or policy == "full"


@pytest.mark.parametrize("policy", fast_few(EVICTING))
def test_the_oracle_holds_in_the_fixed_shape_layout(policy):
    """Each compiled step's logits equal the full cache's with the evicted positions masked."""
    model = tiny_llama()
    cache = run_and_check(
        model, policy, ORACLE_PROMPT, budget=12, buffer=4, steps=30, compiled="aot_eager", **_options(policy)
    )
    assert cache.evictions >= 5


@pytest.mark.slow
def test_inductor_compiles_a_step_that_decodes_what_eager_decodes():
    """The real compiler: generated code, not only the captured graph (a policy that reads hidden states,
    one that reads queries)."""
    model = tiny_llama(layers=4)
    for policy in ("epikv", "snapkv"):
        eager = _generate(model, policy, max_new_tokens=40)
        compiled = _generate(model, policy, compile=True, max_new_tokens=40)
        assert [r.token_ids for r in compiled] == [r.token_ids for r in eager], policy
        ran = compiled[0].stats["compile"]
        assert ran["compiled"] and ran["backend"] == "inductor"


@pytest.mark.slow
def test_a_thousand_steps_with_evictions_compile_once_per_batch_size_and_capacity():
    model = tiny_llama(layers=2)
    prompts = [[4 + i % 80 for i in range(n)] for n in (20, 9)]
    settings = dict(policy="streaming", budget=24, buffer=8, max_new_tokens=1000, ignore_eos=True)
    capacities = set()

    def note_capacity(step, cache):
        capacities.add((len(prompts), cache.layers[0].capacity))

    first = reasonkv.generate(model, None, prompts, compile="eager", on_step=note_capacity, **settings)
    ran = first[0].stats["compile"]
    assert min(r.stats["evictions"] for r in first) >= 100
    assert 1 <= ran["compilations"] <= len(capacities) <= 3  # the capacity settles after the first evictions
    assert ran["warmup_seconds"] > 0
    # A second run on the same model, at the same shapes, traces nothing.
    again = reasonkv.generate(model, None, prompts, compile="eager", **settings)
    assert again[0].stats["compile"]["compilations"] == 0
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


def test_what_has_no_fixed_shape_runs_eager_and_says_why(tokenizer):
    tiered = reasonkv.generate(
        tiny_llama(),
        tokenizer,
        "a prompt",
        policy="h2o",
        budget=8,
        buffer=4,
        quantized=16,
        bits=4,
        max_new_tokens=12,
        compile=True,
    )
    ran = tiered[0].stats["compile"]
    assert not ran["compiled"] and "quantized tier" in ran["eager_reason"] and ran["compilations"] == 0
    hybrid = reasonkv.generate(
        tiny_gemma3(), tokenizer, "a prompt", policy="h2o", budget=8, buffer=4, max_new_tokens=12, compile=True
    )
    ran = hybrid[0].stats["compile"]
    assert not ran["compiled"] and "sliding-window" in ran["eager_reason"]


def test_warm_up_is_left_out_of_the_decode_time():
    model = tiny_llama(layers=2)
    torch._dynamo.reset()  # the next run traces its graph again
    result = reasonkv.generate(
        model, None, [PROMPTS[0]], policy="streaming", budget=16, buffer=4, max_new_tokens=8, compile="eager"
    )[0]
    ran = result.stats["compile"]
    assert ran["compilations"] == 1 and ran["warmup_seconds"] > 0
    assert result.stats["decode_seconds"] < ran["warmup_seconds"]  # 7 steps of a 2-layer model, tracing excluded


@pytest.mark.parametrize(
    "compile, message",
    [("fast", "compile must be True, False or a torch.compile backend"), (1, "compile must be True, False")],
)
def test_a_bad_compile_setting_is_a_clear_error(compile, message, tokenizer):
    with pytest.raises(ValueError, match=message):
        reasonkv.generate(tiny_llama(), tokenizer, "x", max_new_tokens=2, compile=compile)


def test_compiled_decode_refuses_a_cache_without_a_model(tokenizer):
    with pytest.raises(ValueError, match="attached to the model"):
        CompiledDecode(tiny_llama(), reasonkv.EvictingCache(8, 4))


@pytest.mark.integration
@pytest.mark.slow
def test_reasonkv_generate_compile_on_the_bundled_model_says_what_ran(monkeypatch, capsys):
    monkeypatch.setattr(reasonkv.generation.loop, "compile_backend", lambda compile: "aot_eager" if compile else None)
    command = ["generate", "--model", "smollm2-135m", "--prompt", "Count to ten:", "--no-chat", "--compile"]
    assert main([*command, "--policy", "h2o", "--budget", "16", "--buffer", "4", "--max-new-tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "compiled (aot_eager): 1 compilation(s)" in out
    tiered = [*command, "--policy", "h2o", "--budget", "16", "--buffer", "4", "--quantized", "32", "--bits", "8"]
    assert main([*tiered, "--max-new-tokens", "8"]) == 0
    assert "decoded eagerly: a quantized tier (quantized=32)" in capsys.readouterr().out


def test_no_garbage_is_collected_while_a_step_is_traced():
    """Collecting a freed model's attention tap puts the original kernel back in transformers' registry:
    that must never happen in the middle of tracing the next model's step (dynamo fails)."""
    seen = []

    def probe(graph, inputs):
        seen.append(gc.isenabled())
        return graph.forward

    torch._dynamo.register_backend(probe, name="reasonkv_gc_probe")
    gone = tiny_llama(layers=2)
    reasonkv.generate(gone, None, [PROMPTS[1]], policy="h2o", budget=8, buffer=4, max_new_tokens=6)
    del gone  # its tap is garbage now, freed at the next collection
    model = tiny_llama(layers=2, seed=1)
    settings = dict(policy="h2o", budget=8, buffer=4, max_new_tokens=24, ignore_eos=True)
    eager = reasonkv.generate(model, None, [PROMPTS[1]], **settings)
    compiled = reasonkv.generate(model, None, [PROMPTS[1]], compile="reasonkv_gc_probe", **settings)
    assert seen and not any(seen) and gc.isenabled()
    assert compiled[0].token_ids == eager[0].token_ids
