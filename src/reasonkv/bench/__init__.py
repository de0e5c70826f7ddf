"""Speed and memory benchmark of the eviction policies (``reasonkv bench``).

Modules, one job each:

- :mod:`~reasonkv.bench.measure`: per-step timing through ``on_step``, windows around a length,
  the split of a step into forward / record / observe / score / gather; decode sweeps;
- :mod:`~reasonkv.bench.prefilled`: the prefill-to-length mode, one cache extended length after length;
- :mod:`~reasonkv.bench.rounds`: entries measured in interleaved rounds, the median round kept;
  :mod:`~reasonkv.bench.warmup`: warm-up until the step time is stable; :mod:`~reasonkv.bench.clock`: the
  GPU's clock beside each window;
- :mod:`~reasonkv.bench.eviction`: the cost of one eviction with ``N`` cached tokens;
- :mod:`~reasonkv.bench.memory`: exact KV bytes, weights, peak-memory readers, the max-batch model;
- :mod:`~reasonkv.bench.maxbatch`: largest batch within a memory limit and its throughput;
- :mod:`~reasonkv.bench.tiers`: the quantized-tier variants;
- :mod:`~reasonkv.bench.compiled`: the compiled variants (``--compile``) and the compiled transformers
  reference;
- :mod:`~reasonkv.bench.variants`: every variant against its plain entry;
- :mod:`~reasonkv.bench.reads`: K/V bytes held and read per decode step (a selection policy reads a part of
  what it holds, an evicting one all of it); :mod:`~reasonkv.bench.layers`: K/V bytes per layer of the
  entries run under an allocation (``--allocation``);
- :mod:`~reasonkv.bench.settings`: every setting of a run, checked once (:class:`BenchSettings`);
  :mod:`~reasonkv.bench.plan`: the entries and their caches; :mod:`~reasonkv.bench.run`: the run
  (:func:`run_bench`); :mod:`~reasonkv.bench.store`: results on disk, resume;
  :mod:`~reasonkv.bench.machine`: what it measured on;
  :mod:`~reasonkv.bench.report`: overhead summary and markdown (its tables: :mod:`~reasonkv.bench.markdown`);
  :mod:`~reasonkv.bench.plots`: PNGs;
  :mod:`~reasonkv.cli.bench`: the command's arguments.
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
