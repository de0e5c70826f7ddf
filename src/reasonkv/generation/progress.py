"""A line per decode on standard error, for commands that decode one prompt several times (``demo``,
``inspect``): each takes minutes on a CPU, and a log file gets no progress bar."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from reasonkv.generation.stats import GenerationResult

__all__ = ["Stages"]


class Stages:
    """``[1/4] full: decoding up to 512 new tokens ...``, then ``[1/4] full: 143 tokens (eos), 12.3 s``."""

    def __init__(self, count: int, max_new_tokens: int, *, enabled: bool = True, stream: TextIO | None = None):
        self.count, self.max_new_tokens, self.enabled = count, max_new_tokens, enabled
        self.stream = stream
        self._done, self._name, self._started = 0, "", 0.0

    def _say(self, text: str) -> None:
        if self.enabled:
            print(f"[{self._done + 1}/{self.count}] {self._name}: {text}", file=self.stream or sys.stderr, flush=True)

    def start(self, name: str) -> None:
        self._name, self._started = name, time.perf_counter()
        self._say(f"decoding up to {self.max_new_tokens} new tokens ...")

    def end(self, result: GenerationResult) -> None:
        seconds = time.perf_counter() - self._started
        evictions = result.stats.get("evictions") or 0
        evicted = f", {evictions} evictions" if evictions else ""
        self._say(f"{result.num_tokens} tokens ({result.finish_reason}){evicted}, {seconds:.1f} s")
        self._done += 1
