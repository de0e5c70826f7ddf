"""Accumulated time per phase (recording, policy update, scoring, gather).

The wall clock, or on CUDA with ``sync=True`` a pair of events per phase, read only when the totals are asked
for (:meth:`Stopwatch.as_dict`): timing adds no synchronisation inside a step. Without ``sync`` on CUDA the
wall clock covers only the launches.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class Stopwatch:
    def __init__(self, sync: bool = False):
        self.events = sync and torch.cuda.is_available()
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, phase: str) -> _Phase:
        """``with stopwatch("record"): ...`` adds the block's time to ``phase``."""
        return _Phase(self, phase)

    def as_dict(self) -> dict[str, float]:
        """Seconds per phase so far (reads the pending CUDA events: one synchronisation)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for phase, start, end in self._pending:
                self.seconds[phase] += start.elapsed_time(end) / 1000.0
            self._pending = []
        return dict(self.seconds)


class _Phase:
    """One timed block (a plain class, not a generator: it runs once per layer and step)."""

    __slots__ = ("watch", "phase", "began", "events")

    def __init__(self, watch: Stopwatch, phase: str):
        self.watch, self.phase = watch, phase

    def __enter__(self) -> None:
        watch = self.watch
        watch.counts[self.phase] += 1
        if watch.events:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        else:
            self.began = time.perf_counter()

    def __exit__(self, *exc) -> None:
        watch = self.watch
        if watch.events:
            self.events[1].record()
            watch._pending.append((self.phase, *self.events))
        else:
            watch.seconds[self.phase] += time.perf_counter() - self.began
