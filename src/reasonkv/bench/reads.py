"""K/V bytes held and read per decode step, side by side for evicting and selection policies.

An evicting policy (and the full cache) reads at every decode step all the K/V it holds. A selection policy
(``quest``, ``seer``) holds every token and reads a part each step: each window of its sweep carries the mean
K/V bytes its decode steps read and what reading all it held would have read, counted by its selector.
"""

from __future__ import annotations

from reasonkv.bench.markdown import cell, table
from reasonkv.bench.memory import format_small_bytes, held_bytes

__all__ = ["read_entry", "reads_markdown", "reads_summary", "window_read"]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def window_read(window: dict, selects: bool) -> float | None:
    """K/V bytes a window's decode steps read, mean per step, every row together: a selection policy's counted
    reads (None if its window has none), an evicting policy's held bytes (it reads all it holds)."""
    if selects:
        return window.get("kv_bytes_read_per_step")
    return held_bytes(window)


def read_entry(record: dict) -> dict:
    """What one sweep record held (the most K/V bytes in use at the end of a window) and read per decode step
    (the mean over its windows: a selection policy's counted reads, with what reading all it held would have
    cost; an evicting policy's held bytes), and a selection policy's side caches (its block summaries)."""
    windows = record.get("windows") or []
    held = [held_bytes(w) for w in windows]
    selects = bool(record.get("selects")) or "selection" in (record.get("totals") or {})
    if selects:
        counted = [w for w in windows if w.get("kv_bytes_read_per_step") is not None]
        read = _mean([w["kv_bytes_read_per_step"] for w in counted])
        full = _mean([w["kv_bytes_full_read_per_step"] for w in counted])
        fraction = read / full if read is not None and full else None
        side = ((record.get("totals") or {}).get("selection") or {}).get("side_cache_bytes")
    else:
        read = full = _mean(held)
        fraction, side = (1.0 if read else None), 0
    return {
        "selects": selects,
        "kv_bytes_held_max": max(held, default=None),
        "kv_bytes_read_per_step": read,
        "kv_bytes_full_read_per_step": full,
        "read_fraction": fraction,
        "side_cache_bytes": side,
    }


def reads_summary(records: list[dict]) -> dict[str, dict]:
    """Policy -> :func:`read_entry` of one batch size's sweep records."""
    return {record["policy"]: read_entry(record) for record in records if record.get("windows")}


def reads_markdown(summary: dict[str, dict], order: list[str]) -> list[str]:
    """The table of bytes held and read per decode step (nothing when no policy selects: read == held)."""
    if not any(entry["selects"] for entry in summary.values()):
        return []
    lines = [
        "K/V bytes held and read per decode step (means over the measured windows, every row together): an "
        "evicting policy reads all it holds; a selection policy holds every token and reads a part (*full read*: "
        "what reading all it held would have cost; *side caches*: its block summaries at the end of the run):",
        "",
    ]
    entries = {name: summary[name] for name in order if name in summary}
    rows = [
        [
            name,
            "selects" if entry["selects"] else "holds what it reads",
            format_small_bytes(entry["kv_bytes_held_max"]),
            format_small_bytes(entry["kv_bytes_read_per_step"]),
            format_small_bytes(entry["kv_bytes_full_read_per_step"]),
            cell(entry["read_fraction"], "{:.3f}"),
            format_small_bytes(entry["side_cache_bytes"]) if entry["selects"] else "-",
        ]
        for name, entry in entries.items()
    ]
    header = ["policy", "kind", "KV held (max)", "KV read per step (mean)", "full read per step (mean)"]
    header += ["read / full", "side caches"]
    return lines + table(header, rows)
