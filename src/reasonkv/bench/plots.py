"""PNG plots of a bench folder (matplotlib, Agg backend): step time and memory against length,
throughput against batch size, and the cost of one eviction. Time and throughput axes start at zero, so
a few percent of noise look like a few percent; memory shows the K/V bytes held (the slots in use), with
the allocated capacity dashed beside them."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from reasonkv.bench.memory import held_bytes
from reasonkv.bench.windows import sweeps_by_batch

__all__ = ["write_plots"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


_MARKERS = "osD^vPX*h<>p"


def _order(names) -> list[str]:
    names = list(dict.fromkeys(names))
    first = [n for n in ("full", "streaming") if n in names]
    return first + sorted(n for n in names if n not in first)


def _rolling_median(values: np.ndarray, width: int) -> np.ndarray:
    width = max(1, min(width, len(values)))
    windows = np.lib.stride_tricks.sliding_window_view(values, width)
    return np.median(windows, axis=1)


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finish(ax, xlabel: str, ylabel: str, **legend) -> None:
    """A curve panel's labels, its y axis from zero, its grid and legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, **legend)


def _step_time(plt, sweeps: dict[int, dict[str, dict]], path: Path) -> None:
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6.5 * len(sweeps), 4.5), squeeze=False)
    for ax, (batch, group) in zip(axes[0], sweeps.items(), strict=True):
        config = next(iter(group.values()))["config"]
        for name in _order(group):
            record = group[name]
            trace = record.get("trace")
            if trace and trace.get("step_s"):
                steps = np.asarray(trace["step_s"], dtype=float) * 1000
                width = int(config.get("window", 32))
                smooth = _rolling_median(steps, width)
                x = np.arange(len(smooth)) + trace["first_length"] + width - 1
                stride = max(1, len(x) // 600)
                (line,) = ax.plot(x[::stride], smooth[::stride], label=name, linewidth=1.2)
                color = line.get_color()
            else:
                color = None
            windows = sorted(record["windows"], key=lambda w: w["length"])
            ax.plot(
                [w["length"] for w in windows],
                [1000 * w["step_mean_s"] for w in windows],
                "o" if trace else "o-",
                color=color,
                label=None if trace else name,
                markersize=4,
            )
        ax.axvline(config["budget"] + config["buffer"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"time per decode step, batch {batch} (K + B dotted)")
        if config.get("prefill_to_length"):
            ax.set_xscale("log", base=2)
            ylabel = f"ms per step (mean of {config['window']} steps)"
        else:
            ylabel = f"ms per step (rolling median of {config['window']}; dots: window mean)"
        _finish(ax, "tokens in the sequence", ylabel)
    _save(plt, fig, path)


def _memory(plt, sweeps: dict[int, dict[str, dict]], path: Path, peak_label: str) -> None:
    batch, group = next(iter(sweeps.items()))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, name in enumerate(_order(group)):
        windows = sorted(group[name]["windows"], key=lambda w: w["length"])
        x = [w["length"] for w in windows]
        marker = _MARKERS[i % len(_MARKERS)]
        (line,) = axes[0].plot(x, [held_bytes(w) / 2**20 for w in windows], marker=marker, label=name, markersize=4)
        allocated = [w["kv_bytes"] / 2**20 for w in windows]
        if allocated != [held_bytes(w) / 2**20 for w in windows]:
            axes[0].plot(x, allocated, linestyle="--", color=line.get_color(), linewidth=0.8, alpha=0.6)
        peaks = [w.get("peak_memory_bytes") for w in windows]
        if all(p is not None for p in peaks):
            axes[1].plot(x, [p / 2**20 for p in peaks], marker=marker, label=name, markersize=4)
    axes[0].set_title(f"K/V bytes held (dashed: allocated), batch {batch}")
    axes[1].set_title(f"peak memory during decode ({peak_label}), batch {batch}")
    # From zero: K/V grows from the lower left, a process's peak memory sits high: the legends go where they do not.
    for ax, corner in zip(axes, ("upper left", "lower right"), strict=True):
        _finish(ax, "tokens in the sequence", "MiB", loc=corner)
    _save(plt, fig, path)


def _throughput(plt, sweeps: dict[int, dict[str, dict]], max_batch: list[dict], path: Path) -> None:
    panels = (1 if sweeps else 0) + (1 if max_batch else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    panel = iter(axes[0])
    if sweeps:
        ax = next(panel)
        curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
        length = None
        for batch, group in sweeps.items():
            for name, record in group.items():
                last = max(record["windows"], key=lambda w: w["length"])
                length = last["length"]
                curves[name].append((batch, last["tokens_per_s"]))
        for name in _order(curves):
            points = sorted(curves[name])
            ax.plot([b for b, _ in points], [t for _, t in points], "o-", label=name, markersize=4)
        ax.set_title(f"throughput at {length} tokens")
        _finish(ax, "batch size", "tokens/s")
    if max_batch:
        ax = next(panel)
        records = [r for r in max_batch if r.get("tokens_per_s")]
        names = _order(r["policy"] for r in records)
        by_name = {r["policy"]: r for r in records}
        bars = ax.bar(names, [by_name[n]["tokens_per_s"] for n in names], color="tab:blue")
        for bar, name in zip(bars, names, strict=True):
            ax.annotate(
                f"b={by_name[name]['measured_batch']}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        config = max_batch[0]["config"]
        ax.set_title(f"largest batch in {config['memory_limit_bytes'] / 2**30:.0f} GiB at {config['length']} tokens")
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=45)
        ax.grid(alpha=0.3, axis="y")
    _save(plt, fig, path)


def _eviction_cost(plt, records: list[dict], path: Path) -> None:
    records = sorted(records, key=lambda r: r["mean_s"])
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(records) + 1.5))
    names = [r["policy"] for r in records]
    ax.barh(names, [1000 * r["mean_s"] for r in records], xerr=[1000 * r["std_s"] for r in records], color="tab:green")
    ax.set_title(f"one eviction with {records[0]['config']['cached']} cached tokens")
    ax.set_xlabel("ms (mean +- std)")
    ax.grid(alpha=0.3, axis="x")
    _save(plt, fig, path)


def write_plots(records: list[dict], out: Path, *, device: str = "cpu") -> list[Path]:
    """Write the PNGs the records allow; returns their paths."""
    plt = _pyplot()
    out = Path(out)
    written = []
    sweeps = {batch: {r["policy"]: r for r in group} for batch, group in sweeps_by_batch(records).items()}
    max_batch = [r for r in records if r.get("mode") == "max-batch"]
    evictions = [r for r in records if r.get("mode") == "eviction-cost"]
    if sweeps:
        written.append(out / "step_time.png")
        _step_time(plt, sweeps, written[-1])
        written.append(out / "memory.png")
        _memory(plt, sweeps, written[-1], "CUDA max allocated" if device.startswith("cuda") else "peak RSS")
    if sweeps or max_batch:
        written.append(out / "throughput.png")
        _throughput(plt, sweeps, max_batch, written[-1])
    if evictions:
        written.append(out / "eviction_cost.png")
        _eviction_cost(plt, evictions, written[-1])
    return written
