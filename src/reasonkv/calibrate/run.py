"""One calibration run (:func:`run_calibration`, the whole of ``reasonkv calibrate``): claim the folder, collect
the missing records, analyse them, and write ``calibration.json`` (the file EPIKV loads), ``correlation.png``,
``results.json`` (every number) and ``summary.md`` beside the records.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from reasonkv.calibrate.bands import Band, write_band_calibration
from reasonkv.calibrate.pipeline import Analysis, analyse, auc_for, collect, open_stores
from reasonkv.calibrate.plot import plot_profiles
from reasonkv.calibrate.settings import CalibrateSettings
from reasonkv.calibrate.store import claim_output
from reasonkv.calibrate.summary import render_summary
from reasonkv.eval.datasets import load_dataset
from reasonkv.models import bundled_model
from reasonkv.policies.calibration import Calibration, default_anatomy
from reasonkv.runs.paths import portable_command

__all__ = ["run_calibration"]

PLOT_FILE = "correlation.png"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_calibration(settings: CalibrateSettings) -> int:
    """Calibrate the layer bands of ``settings.model`` into ``settings.out``; returns 0."""
    with claim_output(settings.out, inputs=[settings.dataset]):
        return _run(settings)


def _problems(settings: CalibrateSettings) -> list:
    problems = load_dataset(settings.dataset)
    if settings.source == "reference":
        problems = [p for p in problems if p.solution]
        if not problems:
            raise ValueError(f"dataset {settings.dataset!r} has no reference solutions; use --source generated")
    if len(problems) < settings.traces:
        _say(f"calibrate: only {len(problems)} usable problems in {settings.dataset}")
    return problems[: settings.traces]


def _run(settings: CalibrateSettings) -> int:
    s, out = settings, settings.out
    problems = _problems(s)
    label_store, signal_store = open_stores(s)
    ids = [p.id for p in problems]
    if s.analyse_only:
        _say(f"calibrate: analysing {len(ids)} traces in {out}")
    else:
        todo = sum(1 for i in ids if i not in label_store or i not in signal_store)
        _say(f"calibrate: {len(ids) - todo} of {len(ids)} traces already in {out}")
        if todo:
            model, tokenizer = s.load(progress=None if s.progress else False)
            collect(model, tokenizer, problems, label_store, signal_store, s)

    analysis = analyse(label_store, signal_store, ids, s)
    calibration = write_band_calibration(
        out / "calibration.json",
        model=s.model,
        profile=analysis.main,
        band_a=analysis.band_a,
        band_b=analysis.band_b,
        extra={"dataset": s.dataset, "source": s.source, "chunk_size": s.labels.chunk_size, "control": s.control},
        min_width=s.min_width,
    )
    default = default_anatomy(analysis.main.num_layers)
    auc_for(analysis, label_store, signal_store, ids, {"default": default, "cal": calibration}, s)
    plot_file = _plot(s, analysis, default)
    bundled = bundled_model(s.model)
    run_info = {
        "model": s.model,
        "weights": f"the bundled {bundled.gguf}, dequantized on load" if bundled else None,
        "dataset": s.dataset,
        "source": s.source,
        "chunk_size": s.labels.chunk_size,
        "horizon": s.labels.horizon,
        "replicates": s.bootstrap,
        "fraction": s.top_fraction,
        "min_width": s.min_width,
        "max_width": s.max_width,
        "command": portable_command(s.command(), s.out),
    }
    summary = render_summary(analysis, calibration=calibration, default=default, run=run_info, plot_file=plot_file)
    (out / "summary.md").write_text(summary, encoding="utf-8")
    results = _results(analysis, calibration, run_info)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    found = [
        f"band {n}: {b.first}..{b.last} ({n.lower()} = {b.representative})"
        for n, b in (("A", analysis.band_a), ("B", analysis.band_b))
        if b is not None
    ]
    _say(f"calibrate: {'; '.join(found) or 'no band found'}; wrote {out}/summary.md")
    return 0


def _plot(s: CalibrateSettings, analysis: Analysis, default: Calibration) -> str | None:
    """The correlation profiles as a PNG; its file name, or None without matplotlib."""
    try:
        plot_profiles(
            s.out / PLOT_FILE,
            [[analysis.profiles[(signal, t)] for signal in ("z", "g")] for t in s.targets],
            analysis,
            default,
            f"{s.model}: layer anatomy on {s.dataset} ({analysis.traces} traces)",
        )
    except ImportError:
        _say("calibrate: matplotlib is not installed; no plot (pip install matplotlib)")
        return None
    return PLOT_FILE


def _band(band: Band | None) -> dict[str, Any] | None:
    return None if band is None else {**asdict(band), "layers": list(band.layers)}


def _results(analysis: Analysis, calibration: Calibration, run_info: dict[str, Any]) -> dict[str, Any]:
    """Every number of the run, as ``results.json`` holds them."""
    return {
        "run": run_info,
        "traces": analysis.traces,
        "chunks": analysis.chunks,
        "seconds_per_trace": round(analysis.seconds_per_trace, 3),
        "cpu_seconds_per_trace": round(analysis.cpu_seconds_per_trace, 3),
        "label_position_rho": analysis.label_position,
        "calibration": {k: v for k, v in calibration.as_dict().items() if k != "profile"},
        "bands": {"a": _band(analysis.band_a), "b": _band(analysis.band_b)},
        "profiles": [p.to_dict() for p in analysis.profiles.values()],
        "auc": {t: [row.to_dict() for row in rows] for t, rows in analysis.auc.items()},
    }
