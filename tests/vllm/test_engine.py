"""The integration end to end, in vLLM's CPU engine: the same greedy tokens as ``reasonkv.generate`` for each
supported policy (3 ragged prompts, 100 tokens, several evictions each), blocks bounded and given back to the
engine's own pool, more requests at once in a small pool (read from vLLM's metrics), and nothing changed without
the ``reasonkv`` key."""

from __future__ import annotations

import gc
import json
import math
from importlib import resources

import pytest
from engines import (
    BLOCK,
    BUDGET,
    BUFFER,
    NEW_TOKENS,
    PROMPTS,
    engine,
    greedy,
    needs_vllm,
    runner_of,
    scheduler_of,
)

needs_vllm()

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402

import reasonkv  # noqa: E402
from reasonkv.hf import model_info  # noqa: E402
from reasonkv.integrations.vllm.scheduler import EvictingScheduler  # noqa: E402
from reasonkv.integrations.vllm.worker import EvictingCPURunner  # noqa: E402
from reasonkv.policies.registry import parse_options  # noqa: E402


@pytest.fixture(scope="module")
def reference_model():
    model, _ = reasonkv.load_model("smollm2-135m", dtype="fp32")
    return model


@pytest.fixture(scope="module")
def reference(reference_model):
    model = reference_model

    def generate(policy: str, **settings) -> list[list[int]]:
        results = reasonkv.generate(
            model, None, PROMPTS, policy=policy, max_new_tokens=NEW_TOKENS, ignore_eos=True, **settings
        )
        return [list(r.token_ids) for r in results]

    return generate


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


# CI runs one policy of each kind of signal: positions only, recent queries, the attention every key received
# (recomputed from the paged keys), and the residual stream; the others are in the slow tier (each starts an
# engine: about a minute on two cores).
SLOW = pytest.mark.slow
POLICIES = ["streaming", "tova", "h2o", "epikv"]
# The query centers the package ships for SmolLM2, passed by path (stats='bundled' is refused inside vLLM).
SHIPPED_CENTERS = resources.files("reasonkv").joinpath("data", "centers", "smollm2-135m.pt")
SLOW_POLICIES = [
    "knorm", "keydiff", "snapkv", "vase-attnv", "vase-dkv", "triattention", "triattention:stats=shipped",
    "raas:protect_prompt=false",  # its default keeps the prompt whole, and one prompt (120) is above K = 64
    "thinkv", "rkv", "lagkv", "random", "curdkv", "expected-attention", "epikv-lag",
]  # fmt: skip


@pytest.mark.parametrize("named", [*POLICIES, *(pytest.param(p, marks=SLOW) for p in SLOW_POLICIES)])
def test_same_tokens_as_reasonkv_with_blocks_bounded(reference, reference_model, named, tmp_path):
    policy, *given = named.split(":")
    options = parse_options(policy, [g.replace("=shipped", f"={SHIPPED_CENTERS}") for g in given])
    stats = tmp_path / "stats.jsonl"
    llm = engine({"policy": policy, "budget": BUDGET, "buffer": BUFFER, "stats_file": str(stats), **options})
    try:
        scheduler, runner = scheduler_of(llm), runner_of(llm)
        assert isinstance(scheduler, EvictingScheduler) and isinstance(runner, EvictingCPURunner)
        tokens = greedy(llm)
        # The rotations the policies read are vLLM's own, and equal transformers' (triattention rotates keys back).
        assert runner.reasonkv_info.rotary == model_info(reference_model).rotary
        pool = scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back (one is vLLM's null block)
    finally:
        _close(llm)
    assert tokens == reference(policy, budget=BUDGET, buffer=BUFFER, **options)
    records = sorted((json.loads(line) for line in stats.read_text().splitlines()), key=lambda r: r["prompt_tokens"])
    assert [r["prompt_tokens"] for r in records] == sorted(len(p) for p in PROMPTS)
    # 26 tokens: due at K + B = 80, then every 16; 70: alike; 120: evicted after its prefill, then every 16.
    assert [r["evictions"] for r in records] == [3, 6, 7]
    bound = math.ceil((BUDGET + BUFFER) / BLOCK) + 1
    assert all(0 < r["peak_blocks_after_first_eviction"] <= bound for r in records)


def test_without_the_key_vllm_is_untouched(reference):
    llm = engine()
    try:
        scheduler = scheduler_of(llm)
        assert type(scheduler) is Scheduler and type(runner_of(llm)) is CPUModelRunner
        assert "allocate_slots" not in vars(scheduler.kv_cache_manager)
        tokens = greedy(llm)
    finally:
        _close(llm)
    assert tokens == reference("full")


def _preemptions(llm) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_eviction_runs_four_long_requests_in_a_pool_where_the_full_cache_preempts(tmp_path):
    """20 blocks of 32: four requests of 120 + 100 tokens need 7 blocks each in full (28), at most 4 evicting (16)."""
    prompts = [list(range(1000 + 150 * i, 1120 + 150 * i)) for i in range(4)]
    small = dict(num_gpu_blocks_override=20, disable_log_stats=False, max_num_seqs=4, max_model_len=256)
    full = engine(**small)
    try:
        greedy(full, prompts)
        full_preemptions = _preemptions(full)
    finally:
        _close(full)
    stats = tmp_path / "stats.jsonl"
    evicting = engine({"policy": "streaming", "budget": BUDGET, "buffer": BUFFER, "stats_file": str(stats)}, **small)
    try:
        tokens = greedy(evicting, prompts)  # a preemption would raise: the integration refuses it
        evicting_preemptions = _preemptions(evicting)
    finally:
        _close(evicting)
    assert full_preemptions > 0
    assert evicting_preemptions == 0 and all(len(t) == NEW_TOKENS for t in tokens)
    assert max(json.loads(line)["peak_blocks"] for line in stats.read_text().splitlines()) <= 5


@pytest.mark.slow
def test_a_preempted_request_resumes_as_reasonkv_decodes_its_longer_prompt(reference_model, tmp_path):
    """8 blocks of 32 for 4 requests of 26 tokens that grow to 3 blocks before their first eviction: some are
    preempted. A resumed request's tokens are reasonkv.generate's given its prompt plus what it had decoded."""
    prompts = [list(range(2000 + 40 * i, 2026 + 40 * i)) for i in range(4)]
    stats_file = tmp_path / "stats.jsonl"
    llm = engine(
        {"policy": "streaming", "budget": BUDGET, "buffer": BUFFER, "stats_file": str(stats_file)},
        num_gpu_blocks_override=8,
        max_model_len=224,  # what 7 blocks hold (vLLM keeps one as its null block): it refuses a longer one
        disable_log_stats=False,
        max_num_seqs=4,
    )
    try:
        tokens = greedy(llm, prompts)
        preemptions = _preemptions(llm)
    finally:
        _close(llm)
    records = {r["request_id"].split("-")[0]: r for r in map(json.loads, stats_file.read_text().splitlines())}
    assert preemptions > 0 and any(r["resumed_at"] for r in records.values())
    for index, (prompt, out) in enumerate(zip(prompts, tokens, strict=True)):
        done = 0
        for resumed in [*records[str(index)]["resumed_at"], len(prompt) + NEW_TOKENS]:
            upto = resumed - len(prompt)  # tokens decoded before this resumption (or the end)
            if upto == done:  # preempted again before decoding anything
                continue
            [expected] = reasonkv.generate(
                reference_model,
                None,
                [prompt + out[:done]],
                policy="streaming",
                budget=BUDGET,
                buffer=BUFFER,
                max_new_tokens=upto - done,
                ignore_eos=True,
            )
            assert out[done:upto] == list(expected.token_ids), (index, done, upto)
            done = upto
