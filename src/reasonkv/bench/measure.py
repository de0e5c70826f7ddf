"""Timing decode steps: per-step timestamps, windows around a length, the split of a step into phases.

:func:`measure_sweep` decodes with :func:`reasonkv.generate` from a short prompt up to the largest length; a
*window* of steps ending at each requested length gives the numbers there (:mod:`reasonkv.bench.prefilled`
reaches a length by a prefill instead). Both time steps with :class:`StepRecorder`; a step that compiled a
graph is left out of the windows, its time reported apart as the warm-up.

A step runs from the end of the previous step's callback to the end of its own forward (on CUDA the callback
synchronises first): sampling, the forward with its recording hooks, the policy update and any eviction. The
evictor's stopwatch splits it into ``record``, ``observe``, ``score`` and ``gather``; ``forward`` is the rest,
so the five parts sum to the window's mean step time.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence

import torch
from torch._dynamo.utils import counters
from tqdm.auto import tqdm

from reasonkv.bench.clock import gpu_clock_mhz
from reasonkv.bench.memory import PeakTracker, kv_bytes_per_token, window_kv_bytes
from reasonkv.cache import CacheSpec, EvictingCache, kv_bytes_by_kind
from reasonkv.generation import generate
from reasonkv.hf import synchronize, vocab_size

__all__ = [
    "PHASES",
    "StepRecorder",
    "WARMUP_STEPS",
    "entry_label",
    "free_memory",
    "make_prompts",
    "measure_sweep",
    "model_device",
    "model_dtype",
    "progress_bar",
    "window_stats",
]

PHASES = ("record", "observe", "score", "gather")
WARMUP_STEPS = 2  # untimed decode steps after a prefill


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def free_memory(device: torch.device) -> None:
    """What the last measurement left collected (CUDA's cached blocks given back), before the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_prompts(vocab_size: int, batch: int, length: int, seed: int) -> list[list[int]]:
    """``batch`` fixed random token-id prompts of ``length`` ids (seeded; no padding needed), drawn above the
    low end of the vocabulary, where tokenizers keep their special tokens."""
    if length < 1:
        raise ValueError(f"prompt length must be at least 1, got {length}")
    low = min(100, vocab_size // 2)
    return torch.randint(low, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)).tolist()


def window_stats(
    step_seconds: Sequence[float],
    phases_before: dict[str, float],
    phases_after: dict[str, float],
    *,
    evictions: int,
    batch: int,
) -> dict:
    """Numbers for one window of decode steps, from the evictor's cumulative phase seconds at its edges: each
    phase amortised over its steps, ``forward`` the rest, so that ``sum(split.values()) == step_mean_s``."""
    n = len(step_seconds)
    if n == 0:
        raise ValueError("a window needs at least one decode step")
    mean = sum(step_seconds) / n
    phases = {p: max(0.0, phases_after.get(p, 0.0) - phases_before.get(p, 0.0)) / n for p in PHASES}
    split = {"forward": mean - sum(phases.values()), **phases}
    return {
        "window_steps": n,
        "step_median_s": statistics.median(step_seconds),
        "step_mean_s": mean,
        "step_min_s": min(step_seconds),
        "step_max_s": max(step_seconds),
        "split_s": split,
        "eviction_overhead_s": sum(phases.values()),
        "evictions": evictions,
        "tokens_per_s": batch / mean if mean > 0 else float("nan"),
    }


def _read_counts(selector) -> tuple[int, int, int]:
    """A selection policy's counts so far: decode steps, and K/V bytes read and held at those reads (every
    row, layer and kv-head)."""
    if selector.read_tokens is None:
        return selector.steps, 0, 0
    size = selector.token_bytes
    return selector.steps, int(selector.read_tokens.sum()) * size, int(selector.held_tokens.sum()) * size


def _window_reads(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict:
    """A window's ``kv_bytes_read_per_step`` and ``kv_bytes_full_read_per_step`` (what reading all held would
    read), means over its decode steps, every row together (a selection policy)."""
    steps = after[0] - before[0]
    if steps <= 0:
        return {}
    return {
        "kv_bytes_read_per_step": (after[1] - before[1]) / steps,
        "kv_bytes_full_read_per_step": (after[2] - before[2]) / steps,
    }


def _allocated_reading(cache: EvictingCache) -> dict:
    """Under an allocation (heads keep different numbers of tokens): ``kv_bytes_used`` counts each head's own
    tokens (not the slots of the widest), and per evicting layer ``kv_bytes_by_layer`` the K/V storage it holds
    (ragged: its heads' regions, room for ``B`` more included; padded: its slots in use) and
    ``kv_bytes_used_by_layer`` its heads' tokens."""
    layers = [cache.layers[i] for i in cache.full_layers]
    started = [layer for layer in layers if layer.is_initialized]
    if not started:
        return {}
    heads = started[0].positions.shape[1]
    head_token = cache.full_token_kv_bytes() // (len(layers) * heads)  # one token of one head of one layer
    used = [int((layer.positions >= 0).sum()) * head_token if layer.is_initialized else 0 for layer in layers]
    return {
        "kv_bytes_used": sum(used),
        "kv_bytes_by_layer": [int(layer.held_bytes()) if layer.is_initialized else 0 for layer in layers],
        "kv_bytes_used_by_layer": used,
    }


class StepRecorder:
    """The ``on_step(step, cache)`` callback: step times, phase snapshots and memory at window edges.

    After decode step ``s`` a row has seen ``prompt_length + s`` tokens (its length). ``windows`` maps a window's
    end length to its start: it covers the steps whose length is in ``(start, end]``. The peak-memory counter is
    reset at length ``peak_from`` (None: the end of the prefill), so that a window's peak leaves out the
    prefill's. A step that compiled a graph is timed but left out of every window (:attr:`compiling_steps`).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        prompt_length: int,
        windows: dict[int, int],
        batch: int,
        bar=None,
        peak_from: int | None = None,
    ):
        self.device = device
        self.prompt_length = prompt_length
        self.windows = dict(windows)
        self.batch = batch
        self.bar = bar
        self.step_seconds: list[float] = []
        self.snapshots: dict[int, tuple[dict[str, float], int]] = {}
        self.reads: dict[int, tuple[int, int, int]] = {}  # length -> a selector's (steps, read, held) tokens
        self.readings: dict[int, dict] = {}
        self.tracker = PeakTracker(device)
        self.peak_from = prompt_length if peak_from is None else peak_from
        self._snap_at = set(self.windows) | set(self.windows.values())
        self._resume = 0.0
        self.compiling_steps: set[int] = set()  # indices into step_seconds
        self._graphs = counters["stats"]["unique_graphs"]

    def __call__(self, step: int, cache) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        if step != 0:  # step 0: the prefill's end
            self.step_seconds.append(now - self._resume)
            if counters["stats"]["unique_graphs"] != self._graphs:
                self.compiling_steps.add(len(self.step_seconds) - 1)
            if self.bar is not None:
                self.bar.update(1)
        self._graphs = counters["stats"]["unique_graphs"]
        length = self.prompt_length + step
        if length in self._snap_at:
            evictor = getattr(cache, "evictor", None)  # transformers' own cache has none: no phases
            self.snapshots[length] = ({}, 0) if evictor is None else (evictor.timings, evictor.eviction_count)
            selector = getattr(evictor, "selector", None)
            if selector is not None:  # a selection policy: its reading counts so far
                self.reads[length] = _read_counts(selector)
        if length in self.windows:
            self.readings[length] = {**self._read(cache), "gpu_clock_mhz": gpu_clock_mhz(self.device)}
        if length == self.peak_from:
            self.tracker.reset()
        self._resume = time.perf_counter()

    def _read(self, cache) -> dict:
        by_kind = kv_bytes_by_kind(cache.layers)
        if isinstance(cache, EvictingCache):
            # under an allocation heads keep different numbers: what each evicting layer holds, and uses
            reading = _allocated_reading(cache) if cache.spec.allocated else {}
            slots, held = cache.slots, cache.kv_bytes()
            used = (cache.slots - cache.low_width) * cache.full_token_kv_bytes() * self.batch  # full precision
        else:  # transformers' own cache: every token it holds is used
            slots, held = cache.get_seq_length(), by_kind["full"] + by_kind["sliding"] + by_kind["linear"]
            used, reading = by_kind["full"], {}
        return {
            "slots": int(slots),
            "kv_bytes": int(held),
            "kv_bytes_full": int(by_kind["full"]),  # the evicting layers (allocated capacity)
            "kv_bytes_quantized": int(by_kind["quantized"]),  # their quantized tier, if any
            "kv_bytes_sliding": int(by_kind["sliding"]),  # the sliding-window layers' stored window
            "kv_bytes_used": int(used),
            "memory_bytes": self.tracker.current(),
            "peak_memory_bytes": self.tracker.peak(),
            **reading,
        }

    def timed(self, first: int = 0, last: int | None = None) -> list[float]:
        """The times of steps ``first`` to ``last`` (indices into :attr:`step_seconds`), less those that compiled."""
        last = len(self.step_seconds) if last is None else last
        return [self.step_seconds[i] for i in range(first, last) if i not in self.compiling_steps]

    def warmup_seconds(self) -> float:
        """The time of the steps that compiled a graph."""
        return sum(self.step_seconds[i] for i in self.compiling_steps)

    def window(self, end: int) -> dict:
        """Statistics of the window ending at length ``end``."""
        start = self.windows[end]
        first, last = start - self.prompt_length, end - self.prompt_length
        if last > len(self.step_seconds) or end not in self.snapshots:
            raise RuntimeError(f"the run stopped before length {end}")
        before, evictions_before = self.snapshots[start]
        after, evictions_after = self.snapshots[end]
        stats = window_stats(
            self.timed(first, last),
            before,
            after,
            evictions=evictions_after - evictions_before,
            batch=self.batch,
        )
        if start in self.reads and end in self.reads:
            stats.update(_window_reads(self.reads[start], self.reads[end]))
        excluded = sum(1 for i in self.compiling_steps if first <= i < last)
        if excluded:
            stats["compiling_steps_excluded"] = excluded
        return {"length": end, "window_start": start, **stats, **self.readings[end]}


def progress_bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True, disable=not enabled)


def entry_label(spec: CacheSpec | None, batch: int) -> str:
    return f"{'transformers' if spec is None else spec.policy.name} batch {batch}"


def measure_sweep(
    model,
    spec: CacheSpec,
    *,
    batch: int,
    prompt_length: int,
    lengths: Sequence[int],
    window: int,
    seed: int = 0,
    progress: bool = False,
    sync_timing: bool = True,
    compile: str | None = None,
) -> dict:
    """Decode ``batch`` seeded random prompts with :func:`reasonkv.generate` and the cache ``spec`` from
    ``prompt_length`` tokens to ``max(lengths)``: one window of (up to) ``window`` steps ending at every length
    (with ``cumulative_tokens_per_s`` from the first decode step), every step's time (``trace``) and the run's
    totals. ``sync_timing`` (CUDA) synchronises around every timed phase for an exact split, at a little speed
    for policies that record inside the forward; ``compile``: a ``torch.compile`` backend for the decode steps.
    """
    device = model_device(model)
    lengths = sorted(set(lengths))
    if lengths[0] <= prompt_length:
        raise ValueError(f"every length must exceed the prompt length {prompt_length}, got {lengths[0]}")
    prompts = make_prompts(vocab_size(model), batch, prompt_length, seed)
    steps = lengths[-1] - prompt_length
    with progress_bar(steps, entry_label(spec, batch), progress) as bar:
        recorder = StepRecorder(
            device=device,
            prompt_length=prompt_length,
            windows={length: max(prompt_length, length - window) for length in lengths},
            batch=batch,
            bar=bar,
        )
        results = generate(
            model,
            None,
            prompts,
            spec,
            max_new_tokens=steps + 1,
            ignore_eos=True,
            on_step=recorder,
            sync_timing=sync_timing and device.type == "cuda",
            compile=compile or False,
        )
    stats = results[0].stats
    windows = []
    for length in lengths:
        entry = recorder.window(length)
        done = recorder.timed(0, length - prompt_length)
        entry["cumulative_tokens_per_s"] = batch * len(done) / sum(done)
        windows.append(entry)
    timed = recorder.timed()
    result = {
        "prompt_length": prompt_length,
        "kv_bytes_per_token": kv_bytes_per_token(model, model_dtype(model)),
        "window_kv_bytes": window_kv_bytes(model, model_dtype(model)),
        "windows": windows,
        "trace": {"first_length": prompt_length + 1, "step_s": [round(s, 7) for s in recorder.step_seconds]},
        "totals": {
            "decode_steps": len(recorder.step_seconds),
            "prefill_s": stats["prefill_seconds"],
            "decode_s": sum(timed),
            "tokens_per_s": batch * len(timed) / sum(timed),
            "evictions": int(stats["evictions"]),
            "peak_slots": int(stats["peak_slots"]),
            "phases_s": dict(stats["timings"]),
        },
    }
    if "selection" in stats:  # a selection policy: the K/V bytes a decode step read, beside those held
        result["totals"]["selection"] = stats["selection"]
    if compile:
        result["compile"] = stats["compile"]
    return result
