"""Phase timing that does not change what it times: on CUDA, events read once per measurement,
never a synchronisation inside a layer or a step."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from reasonkv.cache.timing import Stopwatch
from reasonkv.hf import cache_keyword


class _FakeEvent:
    """Stands in for torch.cuda.Event on a machine without CUDA: counts what the stopwatch does."""

    recorded = 0
    synchronized = 0

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        _FakeEvent.recorded += 1

    def synchronize(self):
        _FakeEvent.synchronized += 1

    def elapsed_time(self, end):
        return 2.0  # milliseconds


def test_cuda_phases_are_timed_by_events_read_once(monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synchronized.append(1))
    _FakeEvent.recorded = _FakeEvent.synchronized = 0
    model = tiny_llama()
    cache = reasonkv.EvictingCache(12, 4, model=model, policy="h2o", sync_timing=True)
    assert cache.evictor.stopwatch.events
    key = cache_keyword(model)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[3 + i for i in range(20)]]), **{key: cache})
        for _ in range(12):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), **{key: cache})
    cache.detach()
    assert synchronized == [] and _FakeEvent.synchronized == 0  # nothing waited during the steps
    assert _FakeEvent.recorded > 2 * 12  # two events per timed phase
    timings = cache.evictor.timings
    assert _FakeEvent.synchronized == 1  # the totals were read with one wait
    counts = cache.evictor.stopwatch.counts
    assert timings["observe"] == pytest.approx(2.0 / 1000 * counts["observe"])
    assert set(timings) >= {"observe", "score", "gather"}


def test_cpu_phases_use_the_wall_clock():
    watch = Stopwatch(sync=True)
    assert not watch.events or torch.cuda.is_available()
    with watch("score"):
        sum(range(1000))
    assert watch.as_dict()["score"] > 0 and watch.counts["score"] == 1
