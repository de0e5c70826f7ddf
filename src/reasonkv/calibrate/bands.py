"""Band discovery: the layers whose change marks important chunks (A) and filler (B), by the rule of
docs/calibrate.md (significant runs of at least ``min_width`` layers, cut to ``max_width``, the strongest wins), and
the calibration file EPIKV loads, where a side without a band still names layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from reasonkv.calibrate.profile import Profile
from reasonkv.policies.calibration import Calibration, default_anatomy

__all__ = ["Band", "find_band", "discover_bands", "write_band_calibration"]


@dataclass(frozen=True)
class Band:
    """A contiguous band of layers with its representative layer and mean correlation."""

    layers: tuple[int, ...]
    representative: int
    rho: float
    low: float
    high: float

    @property
    def first(self) -> int:
        return self.layers[0]

    @property
    def last(self) -> int:
        return self.layers[-1]


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, flag in enumerate([*flags.tolist(), False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def find_band(profile: Profile, sign: int, *, min_width: int = 3, max_width: int = 8) -> Band | None:
    """The band of one sign (+1: A, -1: B) by the module's rule, or ``None``."""
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    rho = profile.rho * sign
    with np.errstate(invalid="ignore"):
        significant = (profile.low > 0) if sign > 0 else (profile.high < 0)
    significant = significant & ~np.isnan(profile.rho)
    best: tuple[float, int, int] | None = None
    for start, end in _runs(significant):
        if end - start < min_width:
            continue
        width = min(end - start, max_width)
        windows = [(float(rho[s : s + width].mean()), s) for s in range(start, end - width + 1)]
        strength, s = max(windows, key=lambda w: (w[0], -w[1]))
        if best is None or strength > best[0]:
            best = (strength, s, s + width)
    if best is None:
        return None
    layers = tuple(range(best[1], best[2]))
    representative = max(layers, key=lambda layer: (rho[layer], -layer))
    mean, low, high = profile.band(layers)
    return Band(layers, int(representative), mean, low, high)


def discover_bands(profile: Profile, *, min_width: int = 3, max_width: int = 8) -> tuple[Band | None, Band | None]:
    """``(band A, band B)`` of a profile."""
    return tuple(find_band(profile, sign, min_width=min_width, max_width=max_width) for sign in (1, -1))


def write_band_calibration(
    path: str | os.PathLike,
    *,
    model: str,
    profile: Profile,
    band_a: Band | None,
    band_b: Band | None,
    extra: dict[str, object] | None = None,
    min_width: int = 3,
):
    """Write (and return) the :class:`~reasonkv.policies.calibration.Calibration` EPIKV loads, recording whether
    each band was found, the rule's inputs and the per-layer profile; a side without a band is filled by the rule."""
    default = default_anatomy(profile.num_layers)
    a, layers_a = _side(band_a, band_b, (default.a, tuple(default.band_a)), profile, 1, min_width)
    b, layers_b = _side(band_b, band_a, (default.b, tuple(default.band_b)), profile, -1, min_width)
    info: dict[str, object] = {
        "band_a_found": band_a is not None,
        "band_b_found": band_b is not None,
        "signal": profile.signal,
        "target": profile.target,
        "traces": profile.n_traces,
        "profile": profile.to_dict(),
    }
    for name, band in (("band_a", band_a), ("band_b", band_b)):
        if band is not None:
            info[f"{name}_rho"] = [round(band.rho, 6), round(band.low, 6), round(band.high, 6)]
    info.update(extra or {})
    return Calibration(profile.num_layers, a, b, layers_a, layers_b, model=str(model), extra=info).write(path)


def _side(band: Band | None, other: Band | None, default: tuple, profile: Profile, sign: int, width: int) -> tuple:
    """``(representative, layers)`` of one side of the calibration file (see the module docstring), ``default``
    when neither band was found or the other covers every layer."""
    if band is not None:
        return band.representative, band.layers
    free = [] if other is None else [layer for layer in range(profile.num_layers) if layer not in set(other.layers)]
    if not free:
        return default
    strength = {layer: float(np.nan_to_num(sign * profile.rho[layer], nan=-np.inf)) for layer in free}
    ranked = sorted(free, key=lambda layer: (-strength[layer], layer))
    return ranked[0], tuple(sorted(ranked[: max(1, width)]))
