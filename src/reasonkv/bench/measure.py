"""Timing decode steps: per-step timestamps, windows around a length, the split of a step into phases.

Two ways to reach a length ``L``:

- :func:`measure_sweep` decodes with :func:`reasonkv.generate` from a short prompt up to the
  largest length, timing every step through ``on_step``; a *window* of steps ending at each
  requested length gives the numbers at that length.
- :func:`measure_prefilled` prefills ``L - n - 2`` tokens (a short prompt, then the rest as if
  generated), decodes two untimed warm-up steps, then times ``n`` steps (ending at ``L``) with the
  same cache and hooks. An evicting policy is evicted to ``K`` by the prefill (once, or after each
  prefill chunk once it is due), so the ``n`` steps measure its steady state at length ``L``
  without decoding ``L`` tokens one by one. ``ragged`` staggers the rows (see :func:`ragged_shifts`).

The cache is given as a :class:`~reasonkv.cache.CacheSpec`; the prefilled mode also takes ``None``,
transformers' own cache (the one ``model.generate`` builds, no reasonkv hook). Either mode can run its
decode steps compiled (``compile=``, a ``torch.compile`` backend): a step that compiled a graph is left
out of the windows, and its time is reported apart as the warm-up.

A step's time runs from the end of the previous step's callback to the end of its own forward
(on CUDA the callback synchronises first), so it covers sampling, the forward with its recording
hooks, the policy update and any eviction. The evictor's stopwatch splits it: ``record`` (signal
recording inside the forward), ``observe`` (policy state update), ``score`` (scoring and
selection), ``gather`` (compacting the cache); ``forward`` is the rest (model forward plus loop
overhead), so the five parts sum to the window's mean step time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch._dynamo.utils import counters
from tqdm.auto import tqdm

from reasonkv.bench.compiled import StaticReference
from reasonkv.bench.memory import PeakTracker, kv_bytes_per_token, window_kv_bytes
from reasonkv.cache import CacheSpec, EvictingCache, kv_bytes_by_kind
from reasonkv.generation import generate
from reasonkv.generation.compiled import CompiledDecode
from reasonkv.hf import Forward, native_cache, synchronize, vocab_size

__all__ = [
    "PHASES",
    "StepRecorder",
    "make_prompts",
    "measure_prefilled",
    "measure_sweep",
    "model_device",
    "prefill_chunks",
    "warm_up",
    "window_stats",
]

PHASES = ("record", "observe", "score", "gather")
SPLIT = ("forward", *PHASES)
WARMUP_STEPS = 2  # untimed decode steps after a prefill


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def make_prompts(vocab_size: int, batch: int, length: int, seed: int) -> list[list[int]]:
    """``batch`` fixed random token-id prompts of ``length`` ids (seeded; no padding needed).

    Ids are drawn above the low end of the vocabulary, where tokenizers keep their special tokens.
    """
    if length < 1:
        raise ValueError(f"prompt length must be at least 1, got {length}")
    low = min(100, vocab_size // 2)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab_size, (batch, length), generator=generator)
    return ids.tolist()


def window_stats(
    step_seconds: Sequence[float],
    phases_before: dict[str, float],
    phases_after: dict[str, float],
    *,
    evictions: int,
    batch: int,
) -> dict:
    """Numbers for one window of decode steps.

    ``phases_before``/``phases_after`` are the evictor's cumulative phase seconds at the window's
    edges; each phase is amortised over the window's steps, and ``forward`` is the mean step time
    minus the phases, so ``sum(split.values()) == step_mean_s``.
    """
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


class StepRecorder:
    """The ``on_step(step, cache)`` callback: step times, phase snapshots and memory at window edges.

    Parameters
    ----------
    device
        The model's device (CUDA is synchronised before every timestamp).
    prompt_length
        Tokens per row before the first decode step; after decode step ``s`` a row has seen
        ``prompt_length + s`` tokens (its *length*).
    windows
        Window end length -> window start length: the window covers the steps whose length is in
        ``(start, end]``.
    batch
        Rows decoded together.
    bar
        Optional progress bar, advanced once per decode step.

    A step that traced and compiled a ``torch.compile`` graph (``--compile``) is timed but left out of
    every window and total: its time is the compilation's (:attr:`compiling_steps`, :meth:`warmup_seconds`).
    """

    def __init__(self, *, device: torch.device, prompt_length: int, windows: dict[int, int], batch: int, bar=None):
        self.device = device
        self.prompt_length = prompt_length
        self.windows = dict(windows)
        self.batch = batch
        self.bar = bar
        self.step_seconds: list[float] = []
        self.snapshots: dict[int, tuple[dict[str, float], int]] = {}
        self.readings: dict[int, dict] = {}
        self.tracker = PeakTracker(device)
        self.prefill_done: float | None = None
        self._snap_at = set(self.windows) | set(self.windows.values())
        self._resume = 0.0
        self._per_token: int | None = None
        self.compiling_steps: set[int] = set()  # indices into step_seconds
        self._graphs = counters["stats"]["unique_graphs"]

    def __call__(self, step: int, cache) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        if step == 0:
            self.prefill_done = now
            self.tracker.reset()
        else:
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
        if length in self.windows:
            self.readings[length] = self._read(cache)
        self._resume = time.perf_counter()

    def _read(self, cache) -> dict:
        if not isinstance(cache, EvictingCache):  # transformers' own cache: every token it holds is used
            by_kind = kv_bytes_by_kind(cache.layers)
            held = by_kind["full"] + by_kind["sliding"] + by_kind["linear"]
            return {
                "slots": int(cache.get_seq_length()),
                "kv_bytes": int(held),
                "kv_bytes_full": int(by_kind["full"]),
                "kv_bytes_quantized": 0,
                "kv_bytes_sliding": int(by_kind["sliding"]),
                "kv_bytes_used": int(by_kind["full"]),
                "memory_bytes": self.tracker.current(),
                "peak_memory_bytes": self.tracker.peak(),
            }
        if self._per_token is None:
            layer = cache.layers[cache.full_layers[0]]
            self._per_token = len(cache.full_layers) * 2 * layer.keys.shape[1] * layer.keys.shape[3]
            self._per_token *= layer.keys.element_size()
        by_kind = cache.kv_bytes_by_kind()
        return {
            "slots": int(cache.slots),
            "kv_bytes": int(cache.kv_bytes()),
            "kv_bytes_full": int(by_kind["full"]),  # the evicting layers (allocated capacity)
            "kv_bytes_quantized": int(by_kind["quantized"]),  # their quantized tier, if any
            "kv_bytes_sliding": int(by_kind["sliding"]),  # the sliding-window layers' stored window
            "kv_bytes_used": int((cache.slots - cache.low_width) * self._per_token * self.batch),  # full precision
            "memory_bytes": self.tracker.current(),
            "peak_memory_bytes": self.tracker.peak(),
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
        excluded = sum(1 for i in self.compiling_steps if first <= i < last)
        if excluded:
            stats["compiling_steps_excluded"] = excluded
        return {"length": end, "window_start": start, **stats, **self.readings[end]}


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    return tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True)


def warm_up(model, steps: int = 8) -> None:
    """A short full-cache decode, so one-time costs (kernels, allocator) stay out of the first entry."""
    vocab = vocab_size(model)
    generate(model, None, make_prompts(vocab, 1, 16, seed=12345), max_new_tokens=steps, ignore_eos=True)


def _label(spec: CacheSpec | None, batch: int) -> str:
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
    ``prompt_length`` tokens to ``max(lengths)`` (``seed`` seeds the prompts; the spec, the policy).

    Returns ``{"windows": [...], "trace": {...}, "totals": {...}}``: one window of (up to)
    ``window`` steps ending at every length, the time of every step (``trace["step_s"]``, the
    first at length ``trace["first_length"]``), and the run's totals. Every window also carries
    ``cumulative_tokens_per_s``: tokens over time from the first decode step to its length.
    ``sync_timing`` (CUDA only) synchronises around every timed phase for an exact split; it
    costs policies that record inside the forward a little speed. ``compile`` (a ``torch.compile``
    backend) decodes through ``generate(..., compile=compile)``; the result's ``compile`` is its
    ``stats["compile"]``, and the steps that compiled are left out of every window.
    """
    device = model_device(model)
    lengths = sorted(set(lengths))
    if lengths[0] <= prompt_length:
        raise ValueError(f"every length must exceed the prompt length {prompt_length}, got {lengths[0]}")
    vocab = vocab_size(model)
    prompts = make_prompts(vocab, batch, prompt_length, seed)
    steps = lengths[-1] - prompt_length
    bar = _progress_bar(steps, _label(spec, batch), progress)
    recorder = StepRecorder(
        device=device,
        prompt_length=prompt_length,
        windows={length: max(prompt_length, length - window) for length in lengths},
        batch=batch,
        bar=bar,
    )
    try:
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
    finally:
        if bar is not None:
            bar.close()
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
    if compile:
        result["compile"] = stats["compile"]
    return result


def prefill_chunks(
    total: int, length: int, batch: int, tokens_per_forward: int, *, prompt_length: int, grows: bool
) -> list[int]:
    """Sizes of the forwards that prefill ``total`` tokens before decoding up to ``length``.

    The first forward is the prompt (``prompt_length`` tokens: what the cache and the policies
    treat as the prompt); the rest follows as if generated, in chunks of at most
    ``tokens_per_forward`` tokens summed over the batch (0: all in one forward). A cache that
    grows (the full cache doubles its buffers) gets chunks of ``length / 2**k`` so its buffers end
    at exactly ``length`` slots instead of up to twice that; when ``length`` has no such divisor
    (at least twice the prompt, within the cap) the cap is used as is.
    """
    if total < 1 or prompt_length < 1:
        raise ValueError(f"need at least one prompt token and one prefill token, got {prompt_length} and {total}")
    first = min(prompt_length, total)
    rest = total - first
    if rest == 0:
        return [first]
    per_row = rest if tokens_per_forward <= 0 else max(1, tokens_per_forward // batch)
    sizes = [first]
    if grows:
        k = 1
        while length % (1 << k) == 0 and (length >> k) > per_row:
            k += 1
        chunk = length >> k
        if length % (1 << k) == 0 and 2 * first <= chunk <= per_row:
            # the second forward brings the cache to exactly `chunk` slots; later ones double it
            sizes.append(min(chunk - first, rest))
            rest -= sizes[-1]
            per_row = chunk
    sizes += [per_row] * (rest // per_row)
    if rest % per_row:
        sizes.append(rest % per_row)
    return sizes


def ragged_shifts(batch: int, buffer: int) -> list[int]:
    """Tokens each row of a ragged batch lacks: row ``r`` is ``r x max(1, B // batch)`` tokens behind, so the
    rows reach ``K + B`` at steps spread over one eviction cycle (as prompts of different lengths below
    ``K + B`` make them), instead of all at once."""
    step = max(1, buffer // batch)
    return [row * step for row in range(batch)]


def measure_prefilled(
    model,
    spec: CacheSpec | None,
    *,
    batch: int,
    length: int,
    decode_steps: int,
    window: int | None = None,
    prefill_chunk: int = 0,
    prompt_length: int = 32,
    seed: int = 0,
    bar=None,
    sync_timing: bool = True,
    ragged: bool = False,
    compile: str | None = None,
) -> dict:
    """Prefill the cache ``spec`` with ``batch`` seeded random rows, then time ``decode_steps`` decode steps
    that end at ``length``.

    ``length - decode_steps - WARMUP_STEPS`` tokens are prefilled: a ``prompt_length``-token
    prompt, then the rest as if generated, in the chunks of :func:`prefill_chunks` (an evicting
    policy evicts after a forward once due). The first ``WARMUP_STEPS`` decode steps are not timed
    (one-time costs of a fresh cache). Mirrors :func:`reasonkv.generate` (same cache and hooks,
    greedy, EOS ignored) and resets the peak-memory counter after the prefill, so
    ``peak_memory_bytes`` is the decode's peak. Returns the window's statistics plus
    ``prefill_s``, ``prefill_phases_s`` (the prefill's record / observe / score / gather seconds: for an
    evicting policy, the first eviction of the prompt down to ``K``), ``prefill_evictions``,
    ``prefill_chunks``, ``prefilled_tokens`` and the timed steps' ``step_s``.

    ``spec=None`` runs the same loop with the cache ``model.generate`` itself builds
    (:func:`reasonkv.hf.native_cache`) and no reasonkv hook: the reference for what reasonkv adds.

    ``ragged``: a prefill longer than ``K + B`` leaves every row at ``K``, in step; so the untimed steps
    first stagger the rows, row ``r`` fed padding for its first ``ragged_shifts(batch, B)[r]`` steps (as a
    finished row is), then run ``B + 1`` steps more, so that every row has evicted (and been
    right-aligned) once before the timed steps see the rows evict at different steps. ``row_shifts``
    in the result.

    ``compile`` (a ``torch.compile`` backend) runs the decode steps compiled: through
    :class:`~reasonkv.generation.compiled.CompiledDecode`, or for ``spec=None`` through
    :class:`~reasonkv.bench.compiled.StaticReference` (transformers' ``StaticCache``, its forward compiled).
    The result's ``compile`` says what compiled and how long it took; those steps are not timed.
    """
    if compile and ragged:
        raise ValueError("a compiled decode is measured with rows in step (ragged=False)")
    shifts = ragged_shifts(batch, 0 if spec is None else spec.buffer) if ragged else [0] * batch
    untimed = WARMUP_STEPS + (max(shifts) + spec.buffer + 1 if ragged else 0)
    if decode_steps < 1 or length - decode_steps - untimed < 1:
        raise ValueError(f"length {length} must exceed the {decode_steps} decode steps plus {untimed} untimed steps")
    device = model_device(model)
    prefilled = length - decode_steps - untimed
    window = decode_steps if window is None else min(window, decode_steps)
    vocab = vocab_size(model)
    ids = torch.tensor(make_prompts(vocab, batch, prefilled, seed), device=device)
    plain = spec is None
    grows = plain or spec.trigger is None  # a cache that never evicts grows its buffers as it fills
    chunks = prefill_chunks(prefilled, length, batch, prefill_chunk, prompt_length=prompt_length, grows=grows)
    behind = torch.tensor(shifts, device=device)
    recorder = StepRecorder(
        device=device, prompt_length=prefilled, windows={length: length - window}, batch=batch, bar=bar
    )
    reference = StaticReference(model, length, backend=compile) if plain and compile else None
    if plain:
        cache = native_cache(model) if reference is None else reference.cache
    else:
        cache = EvictingCache(model=model, spec=spec, sync_timing=sync_timing and device.type == "cuda")
        cache.reserve(length)  # as reasonkv.generate does: the buffers are allocated once, at the size the run needs
    decode = CompiledDecode(model, cache, backend=compile) if compile and not plain else None
    forward = Forward(model)
    try:
        with torch.inference_mode():
            synchronize(device)
            start = time.perf_counter()
            offset = 0
            for size in chunks:
                chunk = ids[:, offset : offset + size]
                if reference is not None:
                    logits = reference.prefill(chunk)
                else:
                    logits = forward(chunk, cache, last_logits_only=True).logits[:, -1]
                offset += size
            synchronize(device)
            prefill_s = time.perf_counter() - start
            # The phases so far are the prefill's: its first eviction (score, gather) and its bookkeeping.
            prefill_phases = {} if plain else cache.evictor.timings
            prefill_evictions = 0 if plain else cache.evictor.eviction_count
            recorder(0, cache)
            for step in range(1, decode_steps + untimed + 1):
                next_ids = logits.argmax(-1, keepdim=True)
                if decode is not None:
                    logits = decode(next_ids)
                elif reference is not None:
                    logits = reference.step(next_ids)
                else:
                    stagger = {"attention_mask": (behind < step).long().unsqueeze(1)} if step <= max(shifts) else {}
                    logits = forward(next_ids, cache, last_logits_only=True, **stagger).logits[:, -1]
                recorder(step, cache)
    finally:
        if not plain:
            cache.detach()
    result = recorder.window(length)
    result.update(
        prefilled_tokens=prefilled,
        prompt_length=chunks[0],
        prefill_s=prefill_s,
        prefill_phases_s=prefill_phases,
        prefill_evictions=prefill_evictions,
        prefill_chunks=len(chunks),
        peak_slots=int(cache.get_seq_length() if plain else cache.peak_slots),
        step_s=[round(s, 7) for s in recorder.step_seconds[untimed:]],
    )
    if ragged:
        result["row_shifts"] = shifts
    if decode is not None:
        result["compile"] = decode.describe()
    elif reference is not None:
        result["compile"] = {
            "compiled": True,
            "backend": compile,
            "mode": reference.mode,
            "compilations": len(recorder.compiling_steps),
            "warmup_seconds": recorder.warmup_seconds(),
            "eager_reason": None,
        }
    return result


def measure_prefilled_sweep(
    model,
    spec: CacheSpec | None,
    *,
    batch: int,
    lengths: Sequence[int],
    decode_steps: int,
    window: int | None = None,
    prefill_chunk: int = 0,
    prompt_length: int = 32,
    seed: int = 0,
    progress: bool = False,
    sync_timing: bool = True,
    ragged: bool = False,
    compile: str | None = None,
) -> dict:
    """:func:`measure_prefilled` at every length (one fresh cache each); same record layout as the sweep."""
    lengths = sorted(set(lengths))
    bar = _progress_bar(decode_steps * len(lengths), _label(spec, batch), progress)
    windows = []
    try:
        for length in lengths:
            windows.append(
                measure_prefilled(
                    model,
                    spec,
                    batch=batch,
                    length=length,
                    decode_steps=decode_steps,
                    window=window,
                    prefill_chunk=prefill_chunk,
                    prompt_length=prompt_length,
                    seed=seed,
                    bar=bar,
                    sync_timing=sync_timing,
                    ragged=ragged,
                    compile=compile,
                )
            )
    finally:
        if bar is not None:
            bar.close()
    decode_s = sum(w["step_mean_s"] * w["window_steps"] for w in windows)
    result = {
        "kv_bytes_per_token": kv_bytes_per_token(model, model_dtype(model)),
        "window_kv_bytes": window_kv_bytes(model, model_dtype(model)),
        "windows": windows,
        "totals": {
            "prefill_s": sum(w["prefill_s"] for w in windows),
            "decode_s": decode_s,
            "peak_slots": max(w["peak_slots"] for w in windows),
        },
    }
    if compile:  # one compilation per length at most (a cache of another capacity is another graph)
        result["compile"] = {
            **windows[0]["compile"],
            "compilations": sum(w["compile"]["compilations"] for w in windows),
            "warmup_seconds": sum(w["compile"]["warmup_seconds"] for w in windows),
        }
    return result
