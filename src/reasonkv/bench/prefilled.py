"""Steady-state decode at long lengths without decoding every token: prefill, then time a window of steps.

Measuring an entry at a length ``L`` prefills up to ``L - n - u`` tokens (a short prompt, then the rest as if
generated, in chunks), decodes ``u`` untimed steps (a fresh cache's one-time costs; a ragged batch's stagger)
and times ``n`` decode steps ending at ``L``: an evicting policy, evicted to ``K`` by the prefill, is measured
in its steady state. Lengths are measured shortest first on one cache, each extended to the next by a prefill
of the tokens in between (one cache from 8k to 64k, not 8k + 16k + 32k + 64k tokens of prefill); where it
cannot be (too close a length, transformers' static cache), a fresh one is prefilled, the old one dropped
first. The peak-memory counter is reset right before each timed window, leaving the prefill's peak out.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import torch

from reasonkv.bench.measure import (
    WARMUP_STEPS,
    StepRecorder,
    entry_label,
    make_prompts,
    model_device,
    model_dtype,
    progress_bar,
)
from reasonkv.bench.memory import kv_bytes_per_token, weight_bytes, window_kv_bytes
from reasonkv.bench.rounds import summed_compile
from reasonkv.cache import CacheSpec, EvictingCache
from reasonkv.generation.step import EagerStep, StaticStep, decode, open_step
from reasonkv.hf import native_cache, synchronize, vocab_size
from reasonkv.hf.tap import check_untapped

__all__ = [
    "PrefilledSession",
    "extension_chunks",
    "measure_prefilled",
    "measure_prefilled_sweep",
    "prefill_chunks",
    "ragged_shifts",
]


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
    return sizes + _pieces(rest, per_row)


def _pieces(total: int, size: int) -> list[int]:
    """``total`` in pieces of ``size``, the last one shorter if ``size`` does not divide it."""
    return [size] * (total // size) + ([total % size] if total % size else [])


def ragged_shifts(batch: int, buffer: int) -> list[int]:
    """Tokens each row of a ragged batch lacks: row ``r`` is ``r x max(1, B // batch)`` tokens behind, so the
    rows reach ``K + B`` at steps spread over one eviction cycle (as prompts of different lengths below
    ``K + B`` make them), instead of all at once."""
    return [row * max(1, buffer // batch) for row in range(batch)]


def extension_chunks(total: int, batch: int, tokens_per_forward: int) -> list[int]:
    """Sizes of the forwards that extend a prefilled cache by ``total`` tokens per row: chunks of at most
    ``tokens_per_forward`` tokens summed over the batch (0: one forward)."""
    if total < 1:
        raise ValueError(f"an extension needs at least one token, got {total}")
    return _pieces(total, total if tokens_per_forward <= 0 else max(1, tokens_per_forward // batch))


class PrefilledSession:
    """One entry's cache (``spec``; None: transformers' own, no reasonkv hook), measured at increasing lengths
    up to ``top`` (see the module's text).

    ``prefill_chunk``: most tokens per prefill forward, summed over the batch (0: one forward). ``ragged``: the
    untimed steps first stagger the rows (row ``r`` fed padding for its first ``ragged_shifts(batch, B)[r]``
    steps), then run ``B + 1`` more, so that every row has evicted once before the timed ones. ``compile``: a
    ``torch.compile`` backend for the decode steps (through ``StaticStep`` for transformers' own cache).
    """

    def __init__(
        self,
        model,
        spec: CacheSpec | None,
        *,
        batch: int,
        top: int,
        prefill_chunk: int = 0,
        prompt_length: int = 32,
        seed: int = 0,
        sync_timing: bool = True,
        ragged: bool = False,
        compile: str | None = None,
    ):
        if compile and ragged:
            raise ValueError("a compiled decode is measured with rows in step (ragged=False)")
        self.model, self.spec, self.batch = model, spec, batch
        self.device = model_device(model)
        self.plain = spec is None
        self.prefill_chunk, self.prompt_length = prefill_chunk, prompt_length
        self.sync_timing = sync_timing and self.device.type == "cuda"
        self.ragged, self.compile = ragged, compile
        self.shifts = ragged_shifts(batch, 0 if spec is None else spec.buffer) if ragged else [0] * batch
        self.untimed = WARMUP_STEPS + (max(self.shifts) + spec.buffer + 1 if ragged else 0)
        self._ids = torch.tensor(make_prompts(vocab_size(model), batch, top, seed))
        self._weights = weight_bytes(model) if self.device.type == "cuda" else None
        self.cache = self.step = None
        self.position = 0  # tokens per row the cache has seen

    def close(self) -> None:
        """Detach the cache from the model and drop it (and its decode step), so that its memory is freed."""
        if self.step is not None:
            self.step.close()
        if self.cache is not None and not self.plain:
            self.cache.detach()
        self.cache = self.step = None
        self.position = 0

    def _open(self, length: int) -> None:
        """A fresh cache (the previous one dropped and collected first, so the two never coexist)."""
        had = self.cache is not None
        self.close()
        if had:
            gc.collect()
        if self.plain and self.compile:
            check_untapped(self.model)  # the plain reference runs no reasonkv code
            self.step = StaticStep(self.model, length, backend=self.compile)
            self.cache = self.step.cache
            return
        if self.plain:
            self.cache = native_cache(self.model)
        else:
            self.cache = EvictingCache(model=self.model, spec=self.spec, sync_timing=self.sync_timing)
        self.step = EagerStep(self.model, self.cache)

    def measure(
        self, length: int, decode_steps: int, *, window: int | None = None, bar=None, peak_from_prefill: bool = False
    ) -> dict:
        """Prefill (or extend) up to ``length - decode_steps - untimed`` tokens, decode the untimed steps, time
        ``decode_steps`` steps ending at ``length``; the window's statistics (its last ``window`` steps).

        ``peak_from_prefill``: the peak-memory counter is reset when the prefill ends, not when the window
        starts (what a batch must fit: every decode step, the first ones too)."""
        target = length - decode_steps - self.untimed
        if decode_steps < 1 or target < 1:
            raise ValueError(
                f"length {length} must exceed the {decode_steps} decode steps plus {self.untimed} untimed steps"
            )
        if target > self._ids.shape[1]:
            raise ValueError(f"length {length} is beyond the session's longest length {self._ids.shape[1]}")
        window = decode_steps if window is None else min(window, decode_steps)
        fresh = self.cache is None or self.position >= target or isinstance(self.step, StaticStep)
        total = target if fresh else target - self.position
        if fresh:
            self._open(length)
            grows = self.plain or self.spec.trigger is None
            chunks = prefill_chunks(
                total, length, self.batch, self.prefill_chunk, prompt_length=self.prompt_length, grows=grows
            )
        else:
            chunks = extension_chunks(total, self.batch, self.prefill_chunk)
        evicting = not self.plain
        if evicting:  # buffers allocated once at the size this length needs (a full cache grows to it)
            self.cache.reserve(length)
        before = self.cache.evictor.timings if evicting else {}
        evictions_before = self.cache.evictor.eviction_count if evicting else 0
        recorder = StepRecorder(
            device=self.device,
            prompt_length=target,
            windows={length: length - window},
            batch=self.batch,
            bar=bar,
            peak_from=target if peak_from_prefill else length - window,
        )
        step = self.step
        if self.compile and evicting:  # compiled decode steps over this cache (the prefill stays eager)
            step = open_step(self.model, self.cache, self.compile)
        behind = torch.tensor(self.shifts, device=self.device)

        def next_input(index: int, logits: torch.Tensor):
            if index == decode_steps + self.untimed:
                return None
            late = index < max(self.shifts)  # a ragged batch: the rows still behind are fed padding
            return logits.argmax(-1, keepdim=True), (behind <= index).long().unsqueeze(1) if late else None

        try:
            with torch.inference_mode():
                synchronize(self.device)
                start = time.perf_counter()
                offset = self.position
                for size in chunks:
                    logits = step.prefill(self._ids[:, offset : offset + size].to(self.device))
                    offset += size
                synchronize(self.device)
                prefill_s = time.perf_counter() - start
                # The phases so far are the prefill's: its evictions (score, gather) and its bookkeeping.
                after = self.cache.evictor.timings if evicting else {}
                phases = {name: seconds - before.get(name, 0.0) for name, seconds in after.items()}
                prefill_evictions = (self.cache.evictor.eviction_count if evicting else 0) - evictions_before
                recorder(0, self.cache)
                decode(step, logits, next_input, lambda index: recorder(index, self.cache))
        finally:  # a compiled run is over: its hooks and kernel wrapper go (the next entry may be plain)
            if step is not self.step:
                step.close()
        self.position = length
        result = recorder.window(length)
        peak = result.get("peak_memory_bytes")
        result.update(
            # what the decode needs beyond the weights (CUDA: allocated bytes; a CPU's resident set says less)
            decode_peak_over_weights_bytes=None if peak is None or self._weights is None else peak - self._weights,
            prefilled_tokens=total,
            extended_from=0 if fresh else target - total,
            prompt_length=chunks[0] if fresh else 0,
            prefill_s=prefill_s,
            prefill_phases_s=phases,
            prefill_evictions=prefill_evictions,
            prefill_chunks=len(chunks),
            peak_slots=int(self.cache.get_seq_length() if self.plain else self.cache.peak_slots),
            step_s=[round(s, 7) for s in recorder.step_seconds[self.untimed :]],
        )
        if self.ragged:
            result["row_shifts"] = self.shifts
        if self.compile:
            result["compile"] = step.describe()
        return result


def measure_prefilled(
    model,
    spec: CacheSpec | None,
    *,
    batch: int,
    length: int,
    decode_steps: int,
    peak_from_prefill: bool = False,
    **options,
) -> dict:
    """:class:`PrefilledSession` measured at one length: a fresh cache prefilled, then ``decode_steps`` timed
    decode steps ending at ``length``, as :func:`reasonkv.generate` decodes (greedy, EOS ignored). The window's
    statistics, with the prefill's time, phases, evictions and chunks. ``peak_from_prefill``: the peak counts
    every decode step, not only the window's."""
    session = PrefilledSession(model, spec, batch=batch, top=length, **options)
    try:
        return session.measure(length, decode_steps, peak_from_prefill=peak_from_prefill)
    finally:
        session.close()


def measure_prefilled_sweep(
    model,
    spec: CacheSpec | None,
    *,
    batch: int,
    lengths: Sequence[int],
    decode_steps: int,
    window: int | None = None,
    progress: bool = False,
    **options,
) -> dict:
    """:func:`measure_prefilled` at every length, shortest first, on one cache extended from length to length
    (:class:`PrefilledSession`, its ``options``); same record layout as the decode sweep."""
    lengths = sorted(set(lengths))
    session = PrefilledSession(model, spec, batch=batch, top=lengths[-1], **options)
    try:
        with progress_bar(decode_steps * len(lengths), entry_label(spec, batch), progress) as bar:
            windows = [session.measure(length, decode_steps, window=window, bar=bar) for length in lengths]
    finally:
        session.close()
    result = {
        "kv_bytes_per_token": kv_bytes_per_token(model, model_dtype(model)),
        "window_kv_bytes": window_kv_bytes(model, model_dtype(model)),
        "windows": windows,
        "totals": {
            "prefill_s": sum(w["prefill_s"] for w in windows),
            "decode_s": sum(w["step_mean_s"] * w["window_steps"] for w in windows),
            "peak_slots": max(w["peak_slots"] for w in windows),
        },
    }
    if session.compile:  # a graph per cache capacity at most: a full cache grows with the length, the others do not
        result["compile"] = summed_compile([w["compile"] for w in windows])
    return result
