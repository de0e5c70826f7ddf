"""Per-chunk scores of every policy that has a per-token score, from a cached signals record.

EPIKV's scores are linear in the per-layer signals, so their chunk means follow from those of ``g_l`` and ``z_l``
for any layer choice, without another forward (the table: docs/calibrate.md); each is scored at every layer
choice given (suffix ``@default``, ``@cal``). The baselines come straight from the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from reasonkv.calibrate.signals import BASELINE_SCORES

__all__ = ["chunk_scores", "epikv_scores"]


def epikv_scores(g: np.ndarray, z: np.ndarray, calibration: Any) -> dict[str, np.ndarray]:
    """The EPIKV-family chunk scores for one layer choice (``a``, ``b``, ``band_a``, ``band_b``)."""
    a, b = calibration.a, calibration.b
    band_a, band_b = list(calibration.band_a), list(calibration.band_b)
    return {
        "epikv": z[a] - z[b],
        "epikv-band": z[band_a].mean(0) - z[band_b].mean(0),
        "epikv-raw": g[a] - g[b],
        "g-bands": g[band_a].mean(0) - g[band_b].mean(0),
        "g-band-a": g[band_a].mean(0),
    }


def chunk_scores(record: Mapping[str, Any], calibrations: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every score of one trace, ``name -> [chunks]``; ``calibrations`` maps a suffix (``"default"``, ``"cal"``)
    to a layer choice."""
    g = np.asarray(record["g"], dtype=float)
    z = np.asarray(record["z"], dtype=float)
    out: dict[str, np.ndarray] = {}
    for suffix, calibration in calibrations.items():
        for name, values in epikv_scores(g, z, calibration).items():
            out[f"{name}@{suffix}"] = values
    for name in BASELINE_SCORES:
        if name in record["scores"]:
            out[name] = np.asarray(record["scores"][name], dtype=float)
    return out
