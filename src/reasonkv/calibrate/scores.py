"""Per-chunk scores of every policy that has a per-token score, from a cached signals record.

EPIKV's scores are linear in the per-layer signals, so their chunk means follow exactly from the
chunk means of ``g_l`` and ``z_l``; any layer choice can be scored without another forward pass:

``epikv``          ``z_a - z_b`` (EPIKV's default ``zscore`` variant)
``epikv-band``     mean ``z`` over band A minus mean ``z`` over band B (``band`` variant)
``epikv-raw``      ``g_a - g_b`` (``raw`` variant, window ``m = 1``)
``g-bands``        mean raw ``g`` over band A minus over band B
``g-band-a``       mean raw ``g`` over band A alone (is the subtraction needed?)

each for the depth-scaled default layers and, when given, for the calibrated ones (suffix
``@cal``; the defaults get ``@default``). The baselines (``knorm``, ``h2o``, ``tova``, ``snapkv``,
``recency``, ``random``) come straight from the record (see :mod:`reasonkv.calibrate.signals`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from reasonkv.calibrate.signals import BASELINE_SCORES

__all__ = ["EPIKV_SCORES", "chunk_scores", "epikv_scores"]

EPIKV_SCORES = ("epikv", "epikv-band", "epikv-raw", "g-bands", "g-band-a")


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
    """Every score of one trace, ``name -> [chunks]``.

    ``calibrations`` maps a suffix (``"default"``, ``"cal"``) to a layer choice.
    """
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
