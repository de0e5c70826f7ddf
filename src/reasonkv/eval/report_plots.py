"""The PNG plots of ``reasonkv report`` (matplotlib, Agg backend), one set per section (:data:`PANELS`).

The full cache is a dashed line (its interval a band); the evicting policies are points per budget, the
budget on the x axis (log scale when they span a factor 4, series set a little apart), or side by side
with one budget. A figure is drawn only when an evicting policy has a value to show.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from reasonkv.eval.report_rows import Row, Section, finite, section_names

__all__ = ["PLOTS", "plot", "plot_names"]

#: The plots of a section, in the order the report shows them.
PLOTS = ("accuracy", "fidelity", "collapse", "throughput")
MARKERS = "osD^vPX*h<>p"
LINESTYLES = ("-", "--", "-.", ":")
# (attribute, interval attributes or None, y label) of each panel of a plot.
PANELS: dict[str, list[tuple[str, tuple[str, str] | None, str]]] = {
    "accuracy": [("accuracy", ("ci_low", "ci_high"), "accuracy (95% Wilson interval)")],
    "collapse": [
        ("collapse_rate", None, "collapse rate (share of answers)"),
        ("early_stop_rate", None, "early stop rate (ended without an answer)"),
    ],
    "throughput": [("tokens_per_second", None, "decode tokens/s (mean over answers)")],
    "fidelity": [
        ("top1_agreement", ("top1_low", "top1_high"), "top-1 agreement with the full cache"),
        ("kl_mean", ("kl_low", "kl_high"), "mean KL(full ‖ evicting) per token"),
        ("answer_logprob_delta", ("answer_low", "answer_high"), "Δ reference-answer log-prob (sum)"),
    ],
}


def _value(row: Row, attr: str) -> float:
    value = getattr(row, attr)
    return value if finite(value) else math.nan


def _series(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """Evicting rows by legend label (the buffer joins the label when a section has several)."""
    evicting = [r for r in rows if r.budget is not None]
    several_buffers = len({r.buffer for r in evicting}) > 1
    out: dict[str, list[Row]] = {}
    for r in evicting:
        out.setdefault(f"{r.policy} B={r.buffer}" if several_buffers else r.policy, []).append(r)
    return out


def _has_data(rows: Sequence[Row], name: str) -> bool:
    return any(not math.isnan(_value(r, attr)) for r in rows if r.budget is not None for attr, _, _ in PANELS[name])


def _positions(budgets: list[int], count: int) -> tuple[bool, dict[tuple[int, int], float]]:
    """``(log scale?, (budget, series index) -> x)``: each series set a little apart from the others."""
    log = len(budgets) > 1 and max(budgets) >= 4 * min(budgets)
    axis = [math.log2(b) if log else float(b) for b in budgets]
    gaps = [b - a for a, b in zip(axis, axis[1:], strict=False)]
    spread = 0.25 * min(gaps) if gaps else 0.0
    out = {}
    for budget, at in zip(budgets, axis, strict=True):
        for i in range(count):
            offset = spread * ((i / (count - 1)) - 0.5) if count > 1 else 0.0
            out[(budget, i)] = 2 ** (at + offset) if log else at + offset
    return log, out


def _full_reference(ax, rows: Sequence[Row], attr: str, band: tuple[str, str] | None) -> None:
    for r in rows:
        y = _value(r, attr)
        if r.budget is None and not math.isnan(y):
            ax.axhline(y, color="black", linestyle="--", linewidth=1, label=f"{r.policy} (no eviction)", zorder=1)
            if band and not math.isnan(_value(r, band[0])):
                ax.axhspan(_value(r, band[0]), _value(r, band[1]), color="black", alpha=0.07, zorder=0)


def _error(rows: Sequence[Row], ys: list[float], band: tuple[str, str] | None, floor: float | None):
    if band is None:
        return None
    pairs = list(zip(rows, ys, strict=True))
    low = [0.0 if math.isnan(_value(r, band[0])) else y - _value(r, band[0]) for r, y in pairs]
    high = [0.0 if math.isnan(_value(r, band[1])) else _value(r, band[1]) - y for r, y in pairs]
    if floor is not None:  # a log axis: an interval reaching below zero is cut at the floor
        low = [min(lo, y - floor) for lo, y in zip(low, ys, strict=True)]
    return [low, high]


def _panel(ax, rows: Sequence[Row], attr: str, band: tuple[str, str] | None, ylabel: str) -> None:
    series = _series(rows)
    budgets = sorted({r.budget for r in rows if r.budget is not None})
    values = [_value(r, attr) for r in rows if r.budget is not None and not math.isnan(_value(r, attr))]
    log_y = attr == "kl_mean" and values and min(values) > 0
    floor = min(values) / 10 if log_y else None
    if len(budgets) == 1:  # one budget: the policies side by side
        names = [name for name, rs in series.items() if not math.isnan(_value(rs[0], attr))]
        for i, name in enumerate(names):
            row = series[name][0]
            y = _value(row, attr)
            ax.errorbar(
                [i], [y], yerr=_error([row], [y], band, floor), fmt=MARKERS[i % len(MARKERS)], capsize=4,
                markersize=7, label=name, zorder=3,
            )  # fmt: skip
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.7, max(len(names) - 0.3, 0.7))
        ax.set_xlabel(f"policy at budget K = {budgets[0]}")
    else:
        log_x, x_of = _positions(budgets, len(series))
        for i, (name, rs) in enumerate(series.items()):
            rs = sorted((r for r in rs if not math.isnan(_value(r, attr))), key=lambda r: r.budget)
            if not rs:
                continue
            ys = [_value(r, attr) for r in rs]
            ax.errorbar(
                [x_of[(r.budget, i)] for r in rs], ys, yerr=_error(rs, ys, band, floor),
                marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)], capsize=3,
                markersize=6, label=name, zorder=3,
            )  # fmt: skip
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("budget K (tokens kept per head)")
    _full_reference(ax, rows, attr, band)
    if log_y:
        ax.set_yscale("log")
    if attr in ("accuracy", "collapse_rate", "early_stop_rate", "top1_agreement"):
        ax.set_ylim(-0.03 if attr != "top1_agreement" else None, 1.03)
    if attr == "tokens_per_second":
        ax.set_ylim(bottom=0)
    if attr == "answer_logprob_delta":
        ax.axhline(0.0, color="grey", linewidth=0.8, zorder=1)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)


def _short(label: str, most: int = 36) -> str:
    """A legend label of at most ``most`` characters (a calibration file's path can be long)."""
    return label if len(label) <= most else f"{label[: most // 2 - 1]}…{label[-(most // 2) :]}"


def plot_names(rows: Sequence[Row], *, drawn: bool = True) -> dict[Section, dict[str, str]]:
    """``section -> {plot: file name}`` of every plot :func:`plot` writes for ``rows`` (``drawn`` False: of every
    plot a report of ``rows`` may write, drawn or not: the files its folder owns)."""
    sections = list(dict.fromkeys(r.section for r in rows))
    names = section_names(sections)
    out: dict[Section, dict[str, str]] = {}
    for section in sections:
        part = [r for r in rows if r.section == section]
        stem = names[section][1]
        out[section] = {name: f"{stem}-{name}.png" for name in PLOTS if not drawn or _has_data(part, name)}
    return out


def plot(rows: Sequence[Row], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the PNG plots of every section to ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    titles = section_names(list(dict.fromkeys(r.section for r in rows)))
    written: list[Path] = []
    for section, files in plot_names(rows).items():
        part = [r for r in rows if r.section == section]
        buffers = {r.buffer for r in part if r.budget is not None}
        title = titles[section][0] + (f", B = {next(iter(buffers))}" if len(buffers) == 1 else "")
        for name, file in files.items():
            panels = PANELS[name]
            fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.2), squeeze=False)
            for ax, (attr, band, ylabel) in zip(axes[0], panels, strict=True):
                _panel(ax, part, attr, band, ylabel)
            handles, labels = axes[0][0].get_legend_handles_labels()
            labels = [_short(label) for label in labels]
            fig.suptitle(title, fontsize=9)
            fig.tight_layout()
            # Beside the panels, never over a point; the saved image grows to hold it.
            fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
            path = out_dir / file
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    return written
