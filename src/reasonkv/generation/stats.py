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
    """K/V bytes the cache holds, by tier: ``full`` (the evicting layers' slots in use, padding included; a ragged
    layer's regions), ``quantized`` (the tier) and ``sliding`` (the window layers)."""
    allocated = cache.kv_bytes_by_kind()
    full = sum(
        layer.held_bytes() for layer in cache.layers if isinstance(layer, EvictingLayer) and layer.is_initialized
    )
    return {"full": full, "quantized": allocated["quantized"], "sliding": allocated["sliding"]}


@dataclass
class GenerationResult:
    """One prompt's output; ``stats`` holds the figures measured while it decoded (every key is listed in
    docs/api.md: the row's own counted while it was live, so a prompt gets the same in a batch as alone)."""

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
        self.started = self.prefilled = self.stopped = 0.0  # set from now() by the caller

    def clock(self) -> float:
        """The time, less the seconds the decode step spent tracing graphs so far (reported apart)."""
        return time.perf_counter() - self.step_run.warmup_seconds

    def now(self) -> float:
        synchronize(self.device)
        return self.clock()

    def step(self) -> None:
        """Before each token is sampled: the K/V held and allocated now, if they are the most so far."""
        held = kv_bytes_held(self.cache)
        total = sum(held.values())
        if total > self.peak_kv:
            self.peak_kv, self.peak_tiers = total, {"full": held["full"], "quantized": held["quantized"]}
        self.peak_allocated = max(self.peak_allocated, self.cache.kv_bytes())

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
    """The most tokens a row held at once: every token fed while live (the last output never is) until its first
    eviction; after one, ``K + B`` (or the whole prompt, if longer) plus a tier's ``Q``."""
    if evictions == 0:
        return prompt_tokens + max(output_tokens - 1, 0)
    return max(prompt_tokens, spec.trigger + spec.quantized)
