"""Accumulated time per phase (recording, policy update, scoring, gather).

On the CPU a phase is timed with the wall clock. On CUDA, kernels run asynchronously, so with
``sync=True`` each phase records a pair of CUDA events instead, and the events are read only when the
totals are asked for (:meth:`Stopwatch.as_dict`, once per measurement window): timing never adds a
synchronisation inside a layer or a step, so it does not change what it times. Without ``sync`` on
CUDA, the wall clock covers only the launches.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class Stopwatch:
    def __init__(self, sync: bool = False):
        self.events = sync and torch.cuda.is_available()
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def __call__(self, phase: str):
        self.counts[phase] += 1
        if self.events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((phase, start, end))
            return
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - began

    def as_dict(self) -> dict[str, float]:
        """Seconds per phase so far (reads the pending CUDA events: one synchronisation)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for phase, start, end in self._pending:
                self.seconds[phase] += start.elapsed_time(end) / 1000.0
            self._pending = []
        return dict(self.seconds)
