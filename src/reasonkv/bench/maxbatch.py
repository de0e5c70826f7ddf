"""Largest batch per policy within a memory limit at a given length, and its measured throughput.

This is the comparison R-KV makes: a fixed budget leaves room for more rows than the full cache,
and more rows give more tokens per second.

1. Probe (measured): decode a few steps at length ``L`` with two small batch sizes and record the
   decode's peak memory and the KV bytes the cache allocated. What is not KV, per row, is the
   activation and policy-state overhead; what does not grow with the batch is the fixed part.
2. Compute: KV bytes per row from the exact formula (``L`` tokens for the full cache, ``K + B`` for
   an evicting policy) plus the measured overhead give :class:`~reasonkv.bench.memory.MemoryModel`,
   whose ``max_batch(limit)`` is the batch that fits.
3. Measure: decode at that batch and record tokens/s. When the machine (or ``max_measured_batch``)
   cannot hold that batch, the largest batch that does is measured instead and the record says
   so; when a batch runs out of memory it is halved and retried, and that is recorded too.
"""

from __future__ import annotations

import torch

from reasonkv.bench.measure import free_memory, model_device, model_dtype
from reasonkv.bench.memory import MemoryModel, kv_bytes_per_token, machine_memory_bytes, window_kv_bytes
from reasonkv.bench.prefilled import measure_prefilled
from reasonkv.cache import CacheSpec

__all__ = ["kv_tokens_per_row", "measure_max_batch"]


def kv_tokens_per_row(spec: CacheSpec, length: int) -> int:
    """Tokens of K/V one row of the cache ``spec`` must hold at ``length``: all of them, or at most ``K + B``
    when it evicts."""
    return length if spec.trigger is None else min(length, spec.trigger)


def measure_max_batch(
    model,
    spec: CacheSpec,
    *,
    length: int,
    memory_limit: int,
    decode_steps: int,
    probe_batches: tuple[int, int] = (1, 2),
    probe_steps: int = 4,
    max_measured_batch: int = 256,
    **options,
) -> dict:
    """Probe, compute the batch of the cache ``spec`` that fits ``memory_limit`` at ``length``, measure its
    throughput (``options``: the prefill's ``prefill_chunk``, ``prompt_length``, and the ``seed`` of the random
    prompts, as :class:`~reasonkv.bench.prefilled.PrefilledSession` takes them)."""
    device = model_device(model)
    per_token = kv_bytes_per_token(model, model_dtype(model))
    kv_row = kv_tokens_per_row(spec, length) * per_token + window_kv_bytes(model, model_dtype(model))
    # No phase synchronisation: only whole steps are timed here, and they should run undisturbed.
    # A batch must fit every decode step, the first ones too: the peak counts from the prefill's end.
    common = dict(length=length, sync_timing=False, peak_from_prefill=True, **options)

    probes = []
    for batch in probe_batches:
        free_memory(device)
        result = measure_prefilled(model, spec, batch=batch, decode_steps=probe_steps, **common)
        if result["peak_memory_bytes"] is None:
            raise RuntimeError("this machine cannot reset its peak-memory counter; the max-batch probe needs it")
        kept = {key: result[key] for key in ("kv_bytes", "step_mean_s")}
        probes.append({"batch": batch, "peak_bytes": result["peak_memory_bytes"], **kept})
    memory = MemoryModel.fit(probes, kv_row=kv_row)
    found = memory.max_batch(memory_limit)

    # What the machine itself can hold, with the KV bytes the cache really allocates per row.
    allocated_row = max(p["kv_bytes"] / p["batch"] for p in probes)
    machine = machine_memory_bytes(device)
    machine_batch = MemoryModel(memory.fixed, allocated_row, memory.other_row).max_batch(0.95 * machine)
    target = min(found, machine_batch, max_measured_batch)
    notes = []
    if found == 0:
        notes.append(f"not even one row fits {memory_limit} bytes at length {length}")
    elif target < found:
        why = "the machine's memory" if machine_batch <= max_measured_batch else "--max-measured-batch"
        notes.append(f"measured at batch {target}, not the {found} that fit the limit: capped by {why}")

    attempts, measured = [], None
    batch = target
    while batch >= 1 and measured is None:
        free_memory(device)
        try:
            measured = measure_prefilled(model, spec, batch=batch, decode_steps=decode_steps, **common)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error).lower():
                raise
            attempts.append({"batch": batch, "error": "out of memory"})
            notes.append(f"batch {batch} ran out of memory; halved")
            batch //= 2
    if measured is not None:
        measured.pop("step_s", None)
    return {
        "length": length,
        "memory_limit_bytes": memory_limit,
        "kv_tokens_per_row": kv_tokens_per_row(spec, length),
        "kv_bytes_per_token": per_token,
        "probes": probes,
        "memory_model": memory.as_dict(),
        "max_batch": found,
        "machine_bytes": machine,
        "machine_batch": machine_batch,
        "measured_batch": batch if measured is not None else 0,
        "attempts": attempts,
        "measured": measured,
        "tokens_per_s": measured["tokens_per_s"] if measured is not None else None,
        "notes": notes,
    }
