"""A static figure of an inspection for papers: per evicting run, layers x positions, the share of kv-heads
holding each position after chosen evictions (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from reasonkv.inspect.runs import Inspection

__all__ = ["parse_steps", "retention", "write_figure"]


def parse_steps(text: str) -> list[int]:
    """``"1,4,-1"`` -> ``[1, 4, -1]``: evictions counted from 1, negative from the last; empty: the default."""
    steps = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            step = int(part)
        except ValueError:
            raise ValueError(f"eviction steps are integers (1 = the first, -1 = the last), got {part!r}") from None
        if step == 0:
            raise ValueError("eviction steps count from 1 (the first) or from -1 (the last); 0 is neither")
        steps.append(step)
    return steps


def retention(kept: np.ndarray, heads: int) -> np.ndarray:
    """``[layers, heads, seen]`` bool -> ``[layers, seen]``: the share of heads holding each position."""
    return kept.reshape(-1, heads, kept.shape[-1]).mean(1)


def write_figure(path: Path | str, inspection: Inspection, steps: list[int] | None = None) -> Path:
    """One row per evicting run, one column per chosen eviction (default: first, middle and last)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for run in inspection.runs if run.trace.evictions]
    if not runs:
        raise ValueError("no run evicted anything: there is no retention to draw (raise --max-new-tokens?)")
    columns = len(steps) if steps else 3
    fig, axes = plt.subplots(len(runs), columns, figsize=(3.2 * columns, 2.2 * len(runs)), squeeze=False)
    for r, run in enumerate(runs):
        evictions = run.trace.evictions
        chosen = steps or [1, (len(evictions) + 1) // 2, len(evictions)]
        for c, step in enumerate(chosen):
            ax = axes[r][c]
            if not -len(evictions) <= step <= len(evictions):
                raise ValueError(f"{run.name} evicted {len(evictions)} times; there is no eviction {step}")
            eviction = evictions[step - 1 if step > 0 else step]
            share = retention(eviction.kept_mask(), run.trace.heads)
            image = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
            ax.axvline(len(run.prompt_ids) - 0.5, color="#D55E00", lw=0.8)
            ax.set_title(f"{run.name}: eviction {evictions.index(eviction) + 1} ({eviction.seen} tokens)", fontsize=8)
            ax.set_xlabel("position", fontsize=7)
            ax.set_ylabel("layer", fontsize=7)
            ax.tick_params(labelsize=6)
    fig.colorbar(image, ax=axes, shrink=0.8, label="share of kv-heads holding the token")
    fig.suptitle(f"{inspection.model}: what each layer keeps (prompt ends at the line)", fontsize=9)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return Path(path)
