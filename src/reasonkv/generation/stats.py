"""What ``generate`` returns: each row's output and the figures measured while it decoded."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch

from reasonkv.cache.decisions import Trace
from reasonkv.cache.evicting import EvictingCache
from reasonkv.cache.layer import EvictingLayer
from reasonkv.generation.rows import Rows
from reasonkv.hf import synchronize

__all__ = ["GenerationResult", "Meter", "kv_bytes_held", "peak_row_tokens"]


def kv_bytes_held(cache: EvictingCache) -> dict[str, int]:
    """K/V bytes the cache holds, by tier: ``full`` (the evicting layers' slots in use, padding included,
    not their spare capacity; a ragged layer's regions, :meth:`~reasonkv.cache.layer.EvictingLayer.held_bytes`),
    ``quantized`` (the quantized tier) and ``sliding`` (the window layers)."""
    allocated = cache.kv_bytes_by_kind()
    full = sum(
        layer.held_bytes() for layer in cache.layers if isinstance(layer, EvictingLayer) and layer.is_initialized
    )
    return {"full": full, "quantized": allocated["quantized"], "sliding": allocated["sliding"]}


@dataclass
class GenerationResult:
    """One prompt's output.

    ``stats`` counts what happened while this row was live (from its prompt to its last token), so a
    prompt gets the same per-row figures in a batch as alone: ``evictions``, ``peak_row_tokens``
    (the most tokens this row's cache held at once), ``decode_seconds`` (from the end of prefill to
    this row's last token) and ``tokens_per_second`` (the tokens after the first, which prefill
    yields, over ``decode_seconds``; NaN for a one-token output). Shared by the batch:
    ``prefill_seconds``, ``peak_slots`` (cache slots, padding included), ``batch_size``,
    ``peak_kv_bytes`` (the most K/V bytes held: the slots in use, see :func:`kv_bytes_held`),
    ``peak_kv_bytes_by_tier`` (that peak's full-attention K/V split into ``full`` and ``quantized``),
    ``peak_kv_bytes_allocated`` (the most K/V bytes allocated: storage grows ahead of use, so it can
    exceed what is held), ``steady_kv_bytes`` (this row's K/V right after its evictions, averaged over
    them, per tier, with the full-precision tokens it amounts to; None before its first eviction; see
    :meth:`reasonkv.cache.KVStorage.steady_kv_bytes`), ``peak_memory_bytes`` (CUDA max allocated, or the
    process's peak RSS on CPU), ``timings`` (seconds per eviction phase), ``budget``, ``buffer``,
    ``quantized``, ``bits``, ``allocation`` and ``policy``. Only where they apply: ``selection`` (a selection
    policy's reads), ``compile`` (a compiled decode) and ``past_context`` (``{"context", "tokens"}``: this row's
    prompt and output tokens exceeded the model's context, which ``reasonkv.generate`` decodes with a warning).
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "stop" or "length"
    stats: dict = field(default_factory=dict)
    trace: Trace | None = None  # every eviction of this row, with generate(..., trace=True)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Meter:
    """The clock and the peaks of one ``generate`` call."""

    def __init__(self, cache: EvictingCache, device: torch.device, step):
        self.cache, self.device, self.step_run = cache, device, step
        self.peak_kv, self.peak_tiers, self.peak_allocated = 0, {"full": 0, "quantized": 0}, 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.started = self.prefilled = self.stopped = 0.0

    def clock(self) -> float:
        """The time, less the seconds the decode step spent tracing graphs so far (reported apart)."""
        return time.perf_counter() - self.step_run.warmup_seconds

    def now(self) -> float:
        synchronize(self.device)
        return self.clock()

    def start(self) -> None:
        self.started = self.now()

    def end_prefill(self) -> None:
        self.prefilled = self.now()

    def step(self) -> None:
        """Before each token is sampled: the K/V held and allocated now, if they are the most so far."""
        held = kv_bytes_held(self.cache)
        total = sum(held.values())
        if total > self.peak_kv:
            self.peak_kv, self.peak_tiers = total, {"full": held["full"], "quantized": held["quantized"]}
        self.peak_allocated = max(self.peak_allocated, self.cache.kv_bytes())

    def stop(self) -> None:
        self.stopped = self.now()

    def results(self, rows: Rows, prompt_ids: list[list[int]]) -> list[GenerationResult]:
        rows.close(self.stopped, self.cache)
        cache, spec, peak_memory = self.cache, self.cache.spec, self._peak_memory()
        steady = cache.steady_kv_bytes()
        results = []
        for i, prompt in enumerate(prompt_ids):
            tokens = rows.tokens[i]
            ended_at, evictions = rows.ended[i]
            seconds = ended_at - self.prefilled
            stats = {
                "policy": spec.policy.name,
                "budget": spec.budget,
                "buffer": spec.buffer,
                "quantized": spec.quantized,
                "bits": spec.bits,
                "allocation": spec.allocation,
                "evictions": evictions,
                "peak_row_tokens": peak_row_tokens(len(prompt), len(tokens), evictions, spec),
                "peak_slots": cache.peak_slots,
                "prefill_seconds": self.prefilled - self.started,
                "decode_seconds": seconds,
                "tokens_per_second": (len(tokens) - 1) / seconds if len(tokens) > 1 else float("nan"),
                "batch_size": len(prompt_ids),
                "peak_kv_bytes": self.peak_kv,
                "peak_kv_bytes_by_tier": self.peak_tiers,
                "peak_kv_bytes_allocated": self.peak_allocated,
                "steady_kv_bytes": steady[i],
                "peak_memory_bytes": peak_memory,
                "timings": cache.evictor.timings,
            }
            selector = getattr(cache.evictor, "selector", None)
            if selector is not None:  # a selection policy: what each decode step read, beside what is held
                stats["selection"] = selector.stats(i, held_bytes=self.peak_kv)
            results.append(GenerationResult(rows.text(i), tokens, len(prompt), rows.finish[i] or "length", stats))
        return results

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def peak_row_tokens(prompt_tokens: int, output_tokens: int, evictions: int, spec) -> int:
    """The most tokens a row held at once: every token fed while it was live (the last output token never
    is) until its first eviction; after one, ``K + B``, the trigger (or the whole prompt, if longer), plus
    the ``Q`` of a quantized tier."""
    if evictions == 0:
        return prompt_tokens + max(output_tokens - 1, 0)
    return max(prompt_tokens, spec.trigger + spec.quantized)
