"""K/V bytes per layer of the length sweep's entries run under an allocation (``reasonkv bench --allocation``).

Under an allocation the layers' kv-heads keep different numbers of tokens, so a window's reading carries, per
evicting layer, the K/V storage the layer holds (``kv_bytes_by_layer``) and its heads' own tokens
(``kv_bytes_used_by_layer``); the report sets them beside what the uniform allocation would hold.
"""

from __future__ import annotations

from reasonkv.bench.markdown import table
from reasonkv.bench.memory import format_small_bytes

__all__ = ["layer_markdown", "layer_summary"]


def layer_summary(records: list[dict]) -> dict[str, dict]:
    """Policy -> ``{"length", "held", "used"}``: the per-layer bytes at the longest length that has them (entries
    with no per-layer reading, the full cache's say, are left out)."""
    out = {}
    for record in records:
        windows = [w for w in record.get("windows") or [] if w.get("kv_bytes_by_layer")]
        if not windows:
            continue
        last = max(windows, key=lambda w: w["length"])
        out[record["policy"]] = {
            "length": last["length"],
            "held": list(last["kv_bytes_by_layer"]),
            "used": list(last.get("kv_bytes_used_by_layer") or []),
        }
    return out


def layer_markdown(summary: dict[str, dict], order: list[str], *, uniform_layer_bytes: int | None) -> list[str]:
    """One row per evicting layer: each entry's K/V held (its heads' tokens in brackets) at its longest length,
    and ``uniform_layer_bytes`` (``K + B`` tokens in every head of one layer, the batch's rows) beside them."""
    names = [name for name in order if name in summary]
    if not names:
        return []
    layers = max(len(summary[name]["held"]) for name in names)
    lines = [
        "K/V bytes per layer under the allocation, at each entry's longest length: the storage a layer holds "
        "(ragged: its heads' regions; padded: its slots in use, every head as wide as the widest), in brackets its "
        "heads' own tokens; *uniform* is what every layer holds at K + B tokens per head without an allocation:",
        "",
    ]
    header = ["layer", *(f"{name} @{summary[name]['length']}" for name in names), "uniform (K + B)"]
    rows = []
    for layer in range(layers):
        cells = [str(layer)]
        for name in names:
            held, used = summary[name]["held"], summary[name]["used"]  # used: as long as held, or empty
            text = "-" if layer >= len(held) else format_small_bytes(held[layer])
            cells.append(text + (f" ({format_small_bytes(used[layer])})" if layer < len(used) else ""))
        rows.append([*cells, format_small_bytes(uniform_layer_bytes)])
    totals = {name: (sum(summary[name]["held"]), sum(summary[name]["used"])) for name in names}
    total_uniform = None if uniform_layer_bytes is None else uniform_layer_bytes * layers
    both = [f"{format_small_bytes(totals[n][0])} ({format_small_bytes(totals[n][1])})" for n in names]
    rows.append(["all", *both, format_small_bytes(total_uniform)])
    return lines + table(header, rows)
