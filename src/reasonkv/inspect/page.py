"""One self-contained HTML page of an :class:`~reasonkv.inspect.runs.Inspection` (styles, script and data
inline, nothing fetched), so it opens from ``file://`` and can be mailed or committed.

The data (:func:`page_data`) is JSON inside the page, each eviction's arrays in base64 as the trace holds
them; the script (``page.js``) and the styles (``page.css``) sit next to this module.
"""

from __future__ import annotations

import base64
import html
import json
from importlib import resources
from pathlib import Path

import numpy as np

from reasonkv.inspect.runs import Inspection, Run

__all__ = ["check_page_path", "departure", "page_data", "render_page", "write_page"]

GENERATOR = "reasonkv inspect"  # marks the pages this module wrote: only those are overwritten


def departure(full: list[int], other: list[int]) -> int | None:
    """The first output index where ``other`` differs from ``full`` (one ending first counts), or None."""
    differs = (i for i, (a, b) in enumerate(zip(full, other, strict=False)) if a != b)
    return next(differs, None if len(full) == len(other) else min(len(full), len(other)))


def page_data(inspection: Inspection) -> dict:
    """What the page's script reads (JSON-able)."""
    full = next((run for run in inspection.runs if run.name == "full"), None)
    return {"model": inspection.model, "runs": [_run_data(run, full) for run in inspection.runs]}


def _run_data(run: Run, full: Run | None) -> dict:
    depart = None if full is None or run is full else departure(full.token_ids, run.token_ids)
    trace = run.trace
    evicting, allocated = list(trace.evicting), trace.budgets is not None
    return {
        "name": run.name,
        "settings": trace.settings,
        "prompt": len(run.prompt_ids),
        "pieces": run.pieces,
        "depart": None if depart is None else len(run.prompt_ids) + depart,
        "layers": list(trace.layers),
        "kinds": list(trace.kinds),
        "heads": trace.heads,
        "evictions": [
            {
                "seen": e.seen,
                "kept": _b64(e.kept),
                "before": _b64(e.before),
                "protected": _b64(e.protected),
                "quantized": _b64(e.quantized),
                "scores": _b64(None if e.scores is None else e.scores.astype("<f2")),
                "ranks": _b64(
                    None if e.ranks is None else e.ranks.astype("<i4" if e.ranks.dtype == np.int32 else "<i2")
                ),
                "rankBytes": None if e.ranks is None else e.ranks.dtype.itemsize,
                "signals": {name: _signal(value) for name, value in e.signals.items()},
                # Under an allocation: what each head of the evicting layers kept, beside its budget.
                **({"counts": e.kept_counts()[evicting].tolist()} if allocated else {}),
            }
            for e in trace.evictions
        ],
    }


def _signal(value: np.ndarray) -> dict:
    """A trace's signal for the script: a set of positions (packed, as the masks) or float16 values."""
    if value.dtype == np.uint8:
        return {"kind": "set", "data": _b64(value)}
    return {"kind": "values", "data": _b64(value.astype("<f2"))}


def _b64(array: np.ndarray | None) -> str | None:
    return None if array is None else base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def render_page(inspection: Inspection) -> str:
    if not inspection.runs:
        raise ValueError("an inspection without runs has nothing to show")
    assets = resources.files("reasonkv.inspect")
    script = assets.joinpath("page.js").read_text(encoding="utf-8")
    style = assets.joinpath("page.css").read_text(encoding="utf-8")
    data = json.dumps(page_data(inspection), separators=(",", ":"), default=str).replace("</", "<\\/")
    title = html.escape(f"reasonkv inspect: {inspection.model}, " + ", ".join(r.name for r in inspection.runs))
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="{GENERATOR}">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>
{style}
</style>
</head>
<body>
<header>
  <h1>{title}</h1>
  <div id="settings"></div>
</header>
<section id="controls">
  <label for="moment">eviction</label>
  <input id="moment" type="range" min="0" max="0" value="0" step="1">
  <span id="moment-label"></span>
  <div id="legend"></div>
</section>
<main id="runs"></main>
<aside id="grid-panel" hidden></aside>
<script id="data" type="application/json">{data}</script>
<script>
{script}
</script>
</body>
</html>
"""


def write_page(path: Path | str, inspection: Inspection) -> Path:
    """Write the page to ``path`` (``*.html``: a new file, or a page this function wrote before); returns it."""
    path = check_page_path(path)
    path.write_text(render_page(inspection), encoding="utf-8")
    return path


def check_page_path(path: Path | str) -> Path:
    """``path`` if :func:`write_page` may write it (``reasonkv inspect`` asks before decoding), else an error."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"the page is HTML: name it *.html, got {path}")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; name the page's file")
    if path.exists():
        with open(path, "rb") as handle:
            if f'<meta name="generator" content="{GENERATOR}">'.encode() not in handle.read(4096):
                raise FileExistsError(f"{path} exists and is not a page reasonkv inspect wrote: choose another name")
    return path
