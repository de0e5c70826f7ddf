"""Speed and memory benchmark of the eviction policies (``reasonkv bench``).

:mod:`~reasonkv.bench.settings` checks a run's settings once, :mod:`~reasonkv.bench.plan` turns them into
entries and caches, :mod:`~reasonkv.bench.run` measures them (:mod:`~reasonkv.bench.measure` and
:mod:`~reasonkv.bench.prefilled` for the length sweep, :mod:`~reasonkv.bench.eviction`,
:mod:`~reasonkv.bench.maxbatch`) into :mod:`~reasonkv.bench.store`, and :mod:`~reasonkv.bench.report` and
:mod:`~reasonkv.bench.plots` write what they found; each other module is one kind of variant or summary.
"""

from __future__ import annotations

from reasonkv import lazy_exports

_EXPORTS = {
    "BenchSettings": "reasonkv.bench.settings",
    "MemoryModel": "reasonkv.bench.memory",
    "kv_bytes_per_token": "reasonkv.bench.memory",
    "measure_eviction_cost": "reasonkv.bench.eviction",
    "measure_max_batch": "reasonkv.bench.maxbatch",
    "measure_prefilled": "reasonkv.bench.prefilled",
    "measure_sweep": "reasonkv.bench.measure",
    "run_bench": "reasonkv.bench.run",
    "summarise": "reasonkv.bench.report",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(globals(), _EXPORTS)
