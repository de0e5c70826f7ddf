"""The eviction trace's file: :class:`~reasonkv.cache.decisions.Trace` records (what the evictor decided at
each eviction, per row) saved to one ``.npz`` file and read back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reasonkv.cache.decisions import ARRAYS, Eviction, Trace

__all__ = ["Eviction", "Trace", "load_trace", "save_trace"]

FORMAT = "reasonkv-trace/1"
SIGNAL = "signal."  # the file's key of a signal: "{run}.{eviction}.signal.{name}"


def save_trace(path: Path | str, traces: dict[str, dict]) -> None:
    """Write traces (name -> ``{"trace": Trace, **json-able extras}``) to one ``.npz`` file."""
    arrays: dict[str, np.ndarray] = {}
    meta = {"format": FORMAT, "runs": {}}
    for r, (name, entry) in enumerate(traces.items()):
        trace: Trace = entry["trace"]
        extras = {k: v for k, v in entry.items() if k != "trace"}
        meta["runs"][name] = dict(
            layers=list(trace.layers),
            kinds=list(trace.kinds),
            heads=trace.heads,
            settings=trace.settings,
            seen=[e.seen for e in trace.evictions],
            index=r,
            **extras,
        )
        for e, eviction in enumerate(trace.evictions):
            arrays.update({f"{r}.{e}.{k}": getattr(eviction, k) for k in ARRAYS if getattr(eviction, k) is not None})
            arrays.update({f"{r}.{e}.{SIGNAL}{key}": value for key, value in eviction.signals.items()})
    arrays["meta"] = np.frombuffer(json.dumps(meta, default=str).encode(), dtype=np.uint8)
    with open(path, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def load_trace(path: Path | str) -> dict[str, dict]:
    """Read what :func:`save_trace` wrote: name -> ``{"trace": Trace, **extras}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    try:
        data = np.load(path, allow_pickle=False)
        meta = json.loads(bytes(data["meta"]).decode())
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path} is not a reasonkv trace file ({error})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a reasonkv trace file (format {meta.get('format')!r}, expected {FORMAT})")
    out = {}
    for name, run in meta["runs"].items():
        r = run.pop("index")
        evictions = []
        for e, n in enumerate(run.pop("seen")):
            parts = {k: data[f"{r}.{e}.{k}"] for k in ARRAYS if f"{r}.{e}.{k}" in data}
            prefix = f"{r}.{e}.{SIGNAL}"
            signals = {key[len(prefix) :]: data[key] for key in data.files if key.startswith(prefix)}
            evictions.append(Eviction(seen=n, **parts, signals=signals))
        trace = Trace(
            tuple(run.pop("layers")), tuple(run.pop("kinds")), run.pop("heads"), run.pop("settings"), evictions
        )
        out[name] = {"trace": trace, **run}
    return out
