"""Accumulated wall time per phase (recording, policy update, scoring, gather).

On CUDA, kernels run asynchronously: pass ``sync=True`` to synchronise around every timed phase
(exact split, slightly slower decoding: for benchmarks); without it CUDA times only cover launches.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class Stopwatch:
    def __init__(self, sync: bool = False):
        self.sync = sync and torch.cuda.is_available()
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, phase: str):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start
            self.counts[phase] += 1

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)
