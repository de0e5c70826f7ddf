"""K/V bytes held and read per decode step, side by side for evicting and selection policies.

An evicting policy (and the full cache) reads at every decode step all the K/V it holds: its bytes read per
step are its bytes held. A selection policy (``quest``, ``seer``) holds every token and reads a part of them
each step; its run's ``totals.selection`` (:func:`reasonkv.bench.measure.measure_sweep`, from
``stats["selection"]``) says how much: the mean bytes read per decode step, what reading all it held would have
cost, their ratio and the bytes of its side caches (block summaries).

:func:`reads_summary` gives one entry per policy; :func:`reads_markdown` the report's table.
"""

from __future__ import annotations

from reasonkv.bench.memory import format_bytes, held_bytes

__all__ = ["reads_markdown", "reads_summary"]


def _bytes(value: float | None) -> str:
    """Bytes as KiB below 1 MiB (a small model's cache), else as the rest of the report writes them."""
    if value is not None and abs(value) < 1024**2:
        return f"{value / 1024:.1f} KiB"
    return format_bytes(value)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def read_entry(record: dict) -> dict:
    """``{"selects", "kv_bytes_held_max", "kv_bytes_read_per_step", "kv_bytes_full_read_per_step",
    "read_fraction", "side_cache_bytes"}`` of one sweep record.

    Held: the most K/V bytes in use at the end of a window (a selection policy: the run's peak). Read per step:
    a selection policy's mean over every decode step of the run (``None`` when its record carries no
    ``totals.selection``: a prefilled sweep counts none); an evicting policy's mean over the measured windows
    of the bytes it held, which every step reads whole (its ratio is 1).
    """
    windows = record.get("windows") or []
    held = [held_bytes(w) for w in windows]
    selection = (record.get("totals") or {}).get("selection")
    if selection is not None:
        fraction = selection.get("read_fraction")
        return {
            "selects": True,
            "kv_bytes_held_max": selection.get("kv_bytes_held", max(held, default=None)),
            "kv_bytes_read_per_step": selection["kv_bytes_read_per_step"],
            "kv_bytes_full_read_per_step": selection["kv_bytes_full_read_per_step"],
            "read_fraction": fraction if fraction == fraction else None,  # NaN (nothing held): no ratio
            "side_cache_bytes": selection.get("side_cache_bytes", 0),
        }
    if record.get("selects"):  # a selection policy whose run kept no reading counts (a prefilled sweep)
        return {
            "selects": True,
            "kv_bytes_held_max": max(held, default=None),
            "kv_bytes_read_per_step": None,
            "kv_bytes_full_read_per_step": None,
            "read_fraction": None,
            "side_cache_bytes": None,
        }
    mean = _mean(held)
    return {
        "selects": False,
        "kv_bytes_held_max": max(held, default=None),
        "kv_bytes_read_per_step": mean,
        "kv_bytes_full_read_per_step": mean,
        "read_fraction": 1.0 if mean else None,
        "side_cache_bytes": 0,
    }


def reads_summary(records: list[dict]) -> dict[str, dict]:
    """Policy -> :func:`read_entry` of one batch size's sweep records."""
    return {record["policy"]: read_entry(record) for record in records if record.get("windows")}


def reads_markdown(summary: dict[str, dict], order: list[str]) -> list[str]:
    """The table of bytes held and read per decode step (nothing when no policy selects: read == held)."""
    if not any(entry["selects"] for entry in summary.values()):
        return []
    lines = [
        "K/V bytes held and read per decode step (mean): an evicting policy reads all it holds (mean over the "
        "measured windows); a selection policy holds every token and reads a part (mean over every decode step "
        "of the run; *full read*: what reading all it held would have cost, *side caches*: its block summaries):",
        "",
        "| policy | kind | KV held (max) | KV read per step (mean) | full read per step (mean) | read / full | "
        "side caches |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in order:
        entry = summary.get(name)
        if entry is None:
            continue
        fraction = entry["read_fraction"]
        cells = [
            name,
            "selects" if entry["selects"] else "holds what it reads",
            _bytes(entry["kv_bytes_held_max"]),
            _bytes(entry["kv_bytes_read_per_step"]),
            _bytes(entry["kv_bytes_full_read_per_step"]),
            "-" if fraction is None else f"{fraction:.3f}",
            _bytes(entry["side_cache_bytes"]) if entry["selects"] else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]
