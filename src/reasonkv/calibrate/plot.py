"""The per-layer correlation plot: one panel per label kind, a line per signal with its interval,
the discovered bands shaded and the depth-scaled default bands outlined."""

from __future__ import annotations

import os
from collections.abc import Sequence

from reasonkv.calibrate.pipeline import Analysis
from reasonkv.calibrate.profile import Profile
from reasonkv.policies.calibration import Calibration

__all__ = ["plot_profiles"]

_SIGNAL_STYLE = {"z": ("z-scored g (EPIKV)", "-"), "g": ("raw g", "--")}
_TARGET_TITLE = {
    "later": "mean log-likelihood drop of the later tokens",
    "later_sum": "summed log-likelihood drop of the later tokens",
    "answer": "log-likelihood drop of the final answer",
}


def plot_profiles(
    path: str | os.PathLike, panels: Sequence[Sequence[Profile]], found: Analysis, default: Calibration, title: str
) -> None:
    """Write a PNG: ``panels[i]`` holds the profiles (one per signal) of one label kind, with the bands ``found``
    and the ``default`` ones (``ImportError`` without matplotlib, a dependency of reasonkv: only in a broken
    install)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.4 * len(panels)), sharex=True, squeeze=False)
    for ax, profiles in zip(axes[:, 0], panels, strict=True):
        num_layers = profiles[0].num_layers
        layers = list(range(num_layers))
        for band, color, label in ((found.band_a, "tab:green", "band A"), (found.band_b, "tab:red", "band B")):
            if band is not None:
                ax.axvspan(band.first - 0.5, band.last + 0.5, color=color, alpha=0.15, label=f"{label} (found)")
                ax.axvline(band.representative, color=color, linewidth=1, alpha=0.7)
        for layers_of, color, label in ((default.band_a, "tab:green", "A"), (default.band_b, "tab:red", "B")):
            ax.axvspan(
                min(layers_of) - 0.5,
                max(layers_of) + 0.5,
                fill=False,
                edgecolor=color,
                linestyle=":",
                linewidth=1.5,
                label=f"default {label} (scaled)",
            )
        for profile in profiles:
            name, style = _SIGNAL_STYLE.get(profile.signal, (profile.signal, "-"))
            line = ax.plot(layers, profile.rho, style, marker="o", markersize=3, label=name)[0]
            ax.fill_between(layers, profile.low, profile.high, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.axhline(0, color="black", linewidth=0.8)
        target = profiles[0].target
        ax.set_title(f"{_TARGET_TITLE.get(target, target)} ({profiles[0].n_traces} traces)", fontsize=10)
        ax.set_ylabel("Spearman rho (per trace, mean)")
        ax.set_xlim(-0.5, num_layers - 0.5)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("decoder layer")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, 0].legend(handles, labels, fontsize=8, ncol=3, loc="best")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
