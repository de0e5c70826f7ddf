"""The cost of one eviction when the cache holds ``N = K + B`` tokens.

A prefill of ``N`` tokens makes the cache due once (a warm-up eviction, not counted); each repetition then
feeds ``B`` new tokens in one forward, which triggers one eviction, timed by the evictor's stopwatch as
``score`` and ``gather``. A policy's per-token ``record``/``observe`` work is not part of an eviction.
"""

from __future__ import annotations

import statistics
import time

import torch

from reasonkv.bench.measure import make_prompts, model_device
from reasonkv.bench.prefilled import prefill_chunks
from reasonkv.cache import CacheSpec, EvictingCache
from reasonkv.generation.step import EagerStep
from reasonkv.hf import synchronize, vocab_size

__all__ = ["measure_eviction_cost"]


def measure_eviction_cost(
    model,
    spec: CacheSpec,
    *,
    repeats: int = 5,
    batch: int = 1,
    prefill_chunk: int = 0,
    prompt_length: int = 32,
    seed: int = 0,
) -> dict:
    """Time ``repeats`` evictions of the cache ``spec`` when it holds ``K + B`` tokens per row (``batch`` rows
    of random prompts seeded by ``seed``): each one's seconds, scoring and gathering apart, and their statistics."""
    if spec.trigger is None or spec.buffer < 1:
        raise ValueError(
            f"eviction cost needs a policy that evicts and a buffer of at least 1 token, got {spec.policy.name} "
            f"with buffer {spec.buffer}"
        )
    budget, buffer, cached = spec.budget, spec.buffer, spec.trigger
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = model_device(model)
    ids = torch.tensor(make_prompts(vocab_size(model), batch, cached + buffer * repeats, seed), device=device)
    cache = EvictingCache(model=model, spec=spec, sync_timing=device.type == "cuda")
    evictor = cache.evictor
    step = EagerStep(model, cache)
    score, gather, forward_s = [], [], []
    try:
        with torch.inference_mode():
            offset = 0
            for size in prefill_chunks(cached, cached, batch, prefill_chunk, prompt_length=prompt_length, grows=False):
                step.prefill(ids[:, offset : offset + size])
                offset += size
            if evictor.eviction_count != 1:
                raise RuntimeError(f"expected one warm-up eviction after the prefill, got {evictor.eviction_count}")
            for _ in range(repeats):
                before, count = evictor.timings, evictor.eviction_count
                synchronize(device)
                start = time.perf_counter()
                step.prefill(ids[:, offset : offset + buffer])
                synchronize(device)
                forward_s.append(time.perf_counter() - start)
                offset += buffer
                after = evictor.timings
                if evictor.eviction_count != count + 1:
                    raise RuntimeError("a refill of the buffer did not trigger exactly one eviction")
                score.append(after.get("score", 0.0) - before.get("score", 0.0))
                gather.append(after.get("gather", 0.0) - before.get("gather", 0.0))
    finally:
        cache.detach()
    total = [s + g for s, g in zip(score, gather, strict=True)]
    return {
        "cached": cached,
        "budget": budget,
        "batch": batch,
        "repeats": repeats,
        "eviction_s": total,
        "score_s": score,
        "gather_s": gather,
        "refill_forward_s": forward_s,
        "mean_s": statistics.fmean(total),
        "median_s": statistics.median(total),
        "std_s": statistics.pstdev(total),
        "min_s": min(total),
        "score_mean_s": statistics.fmean(score),
        "gather_mean_s": statistics.fmean(gather),
    }
