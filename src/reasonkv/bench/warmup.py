"""Warm-up until the step time is stable, once per process, before the first entry.

The first decode steps of a process pay one-time costs (kernel selection, the allocator growing, a GPU
leaving its idle clocks) for an unknown number of steps. A fixed count of warm-up steps is either too
few on one machine or wasted on another, so the warm-up decodes windows of steps until the medians of
the last few windows agree within a tolerance, or a cap is reached (then it says it stopped unsettled).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from reasonkv.bench.measure import make_prompts, model_device
from reasonkv.generation.step import EagerStep
from reasonkv.hf import native_cache, synchronize, vocab_size
from reasonkv.suggest.integers import is_int

__all__ = ["WARMUP_CAP_STEPS", "settle", "warm_up"]

WARMUP_CAP_STEPS = 96  # the warm-up's most decode steps (a few seconds even where eager steps take 60 ms)


def settle(
    step: Callable[[], float], *, window: int = 8, last: int = 3, tolerance: float = 0.05, cap: int = WARMUP_CAP_STEPS
) -> dict:
    """Call ``step()`` (it returns its own duration in seconds) in windows of ``window`` calls until the
    medians of the last ``last`` windows lie within ``tolerance`` of each other (largest over smallest,
    minus one), or ``cap`` calls have been made."""
    for name, value, least in (("window", window, 1), ("last", last, 2), ("cap", cap, 1)):
        if not is_int(value) or value < least:
            raise ValueError(f"settle: {name} must be an integer >= {least}, got {value!r}")
    if not tolerance > 0:
        raise ValueError(f"settle: tolerance must be positive, got {tolerance!r}")
    medians: list[float] = []
    steps = 0
    stable = False
    while not stable and steps + window <= cap:
        medians.append(statistics.median(step() for _ in range(window)))
        steps += window
        recent = medians[-last:]
        stable = len(recent) == last and min(recent) > 0 and max(recent) / min(recent) - 1 <= tolerance
    return {"steps": steps, "stable": stable, "window_medians_s": medians}


def warm_up(model) -> dict:
    """Decode from a short fixed prompt with transformers' own cache until the step time is stable
    (:func:`settle`, at most :data:`WARMUP_CAP_STEPS` steps); returns what :func:`settle` returns."""
    device = model_device(model)
    ids = torch.tensor(make_prompts(vocab_size(model), 1, 16, seed=12345), device=device)
    decode_step = EagerStep(model, native_cache(model))
    state = {"ids": ids}

    def step() -> float:
        synchronize(device)
        start = time.perf_counter()
        state["ids"] = decode_step(state["ids"]).argmax(-1, keepdim=True)
        synchronize(device)
        return time.perf_counter() - start

    with torch.inference_mode():
        state["ids"] = decode_step.prefill(ids).argmax(-1, keepdim=True)
        return settle(step)
