"""Per-layer signal profile: the mean over traces of each layer's within-trace Spearman correlation of its
chunk signal with the labels (the chunk position partialled out with ``control="position"``), with a bootstrap
interval that resamples traces. Why within-trace, and why the control: docs/calibrate.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reasonkv.calibrate.stats import bootstrap_indices, interval, nanmean_rows, partial_spearman, spearman

__all__ = ["CONTROLS", "Profile", "layer_profile", "per_trace_correlations"]

CONTROLS = ("position", "none")


@dataclass(frozen=True)
class Profile:
    """Per-layer correlation of one signal (``"g"``, ``"z"``) with one label kind, under ``control``."""

    signal: str
    target: str
    control: str
    rho: np.ndarray  # [layers] mean per-trace Spearman correlation
    low: np.ndarray  # [layers] its bootstrap interval, of coverage ``level``
    high: np.ndarray
    per_trace: np.ndarray  # [traces, layers] (NaN where undefined)
    replicates: np.ndarray  # [replicates, layers] bootstrap means, the same trace resamples for every layer
    level: float

    @property
    def num_layers(self) -> int:
        return int(self.rho.shape[0])

    @property
    def n_traces(self) -> int:
        """Traces that contribute a correlation."""
        return int((~np.isnan(self.per_trace)).any(1).sum())

    def band(self, layers: Sequence[int]) -> tuple[float, float, float]:
        """Mean correlation over ``layers`` and its bootstrap interval."""
        layers = list(layers)
        replicates = self.replicates[:, layers].mean(1)
        low, high = interval(replicates[:, None], self.level)
        return float(self.rho[layers].mean()), float(low[0]), float(high[0])

    def to_dict(self) -> dict[str, object]:
        head = {"signal": self.signal, "target": self.target, "control": self.control, "traces": self.n_traces}
        numbers = {
            k: [None if np.isnan(v) else round(float(v), 6) for v in getattr(self, k)] for k in ("rho", "low", "high")
        }
        return {**head, "level": self.level, **numbers}


def per_trace_correlations(
    signals: Sequence[np.ndarray], labels: Sequence[np.ndarray], control: str = "position"
) -> np.ndarray:
    """``[traces, layers]`` correlations of ``signals[i] [layers, chunks]`` with ``labels[i] [chunks]``
    (partial Spearman given the chunk index for ``control="position"``, plain Spearman for ``"none"``)."""
    if len(signals) != len(labels):
        raise ValueError(f"{len(signals)} signal arrays for {len(labels)} label arrays")
    num_layers = np.asarray(signals[0]).shape[0]
    out = np.full((len(signals), num_layers), np.nan)
    for i, (signal, label) in enumerate(zip(signals, labels, strict=True)):
        signal, label = np.asarray(signal, dtype=float), np.asarray(label, dtype=float)
        if signal.shape != (num_layers, label.shape[0]):
            raise ValueError(
                f"trace {i}: signal shape {signal.shape} does not match {num_layers} layers x {label.shape[0]} chunks"
            )
        position = np.arange(label.shape[0], dtype=float)
        for layer in range(num_layers):
            if control == "position":
                out[i, layer] = partial_spearman(signal[layer], label, position)
            else:
                out[i, layer] = spearman(signal[layer], label)
    return out


def layer_profile(
    signals: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    *,
    signal: str = "z",
    target: str = "later",
    control: str = "position",
    replicates: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> Profile:
    """The per-layer profile with bootstrap intervals (``replicates`` trace resamples, seeded)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    per_trace = per_trace_correlations(signals, labels, control)
    rho = nanmean_rows(per_trace, np.arange(per_trace.shape[0])[None])[0]  # every trace once
    boot = nanmean_rows(per_trace, bootstrap_indices(per_trace.shape[0], replicates, seed))
    low, high = interval(boot, level)
    return Profile(signal, target, control, rho, np.asarray(low), np.asarray(high), per_trace, boot, level)
