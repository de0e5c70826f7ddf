"""Band discovery recovers bands planted in synthetic per-layer signals, and writes a calibration
file that EPIKV loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reasonkv.calibrate.bands import discover_bands, find_band, write_band_calibration
from reasonkv.calibrate.profile import layer_profile
from reasonkv.policies.calibration import default_anatomy, load_calibration

LAYERS = 16


def _synthetic(strength: dict[int, float], traces: int = 60, chunks: int = 12, seed: int = 0):
    """Chunk signals ``[layers, chunks]`` = strength_l * label + noise, per trace."""
    rng = np.random.default_rng(seed)
    signals, labels = [], []
    for _ in range(traces):
        label = rng.gamma(1.0, 1.0, chunks)
        noise = rng.normal(0, 1, (LAYERS, chunks))
        weight = np.array([strength.get(layer, 0.0) for layer in range(LAYERS)])[:, None]
        signals.append(weight * (label - label.mean()) / label.std() + noise)
        labels.append(label)
    return signals, labels


PLANTED = {**{layer: 1.0 for layer in range(3, 8)}, 5: 2.0, **{layer: -0.9 for layer in (10, 11, 12)}, 11: -1.5}


def test_planted_bands_are_recovered():
    profile = layer_profile(*_synthetic(PLANTED), replicates=500)
    band_a, band_b = discover_bands(profile)
    assert band_a.layers == (3, 4, 5, 6, 7) and band_a.representative == 5
    assert band_b.layers == (10, 11, 12) and band_b.representative == 11
    assert band_a.low > 0 and band_b.high < 0
    assert band_a.rho == pytest.approx(profile.rho[3:8].mean())


def test_long_runs_are_cut_to_the_strongest_window_and_short_runs_dropped():
    strength = {layer: 1.0 for layer in range(1, 13)} | {9: 2.0, 10: 2.0, 11: 2.0} | {14: -1.0, 15: -1.0}
    profile = layer_profile(*_synthetic(strength, seed=1), replicates=500)
    band = find_band(profile, 1, min_width=3, max_width=4)
    assert len(band.layers) == 4 and {9, 10, 11} <= set(band.layers)
    assert find_band(profile, -1, min_width=3) is None  # a 2-layer run is not a band
    assert find_band(profile, -1, min_width=2).layers == (14, 15)


def test_pure_noise_has_no_band():
    profile = layer_profile(*_synthetic({}, seed=2), replicates=500)
    assert discover_bands(profile) == (None, None)


def test_calibration_round_trip(tmp_path):
    profile = layer_profile(*_synthetic(PLANTED), replicates=200)
    band_a, band_b = discover_bands(profile)
    path = tmp_path / "calibration.json"
    written = write_band_calibration(path, model="synthetic", profile=profile, band_a=band_a, band_b=band_b)
    loaded = load_calibration(path)
    assert loaded == written
    assert (loaded.a, loaded.b, loaded.band_a, loaded.band_b) == (5, 11, (3, 4, 5, 6, 7), (10, 11, 12))
    data = json.loads(path.read_text())
    assert data["model"] == "synthetic" and data["num_layers"] == LAYERS
    assert data["band_a_found"] and data["band_b_found"] and len(data["profile"]["rho"]) == LAYERS


def test_no_band_found_keeps_the_scaled_default(tmp_path):
    profile = layer_profile(*_synthetic({}, seed=3), replicates=200)
    assert discover_bands(profile) == (None, None)
    path = tmp_path / "c.json"
    write_band_calibration(path, model="m", profile=profile, band_a=None, band_b=None)
    loaded = load_calibration(path)
    default = default_anatomy(LAYERS)  # 16 layers: A 4..7 (a = 5), B 9..13 (b = 11)
    assert (loaded.a, loaded.b, loaded.band_a, loaded.band_b) == (default.a, default.b, default.band_a, default.band_b)
    assert loaded.extra["band_a_found"] is False and loaded.extra["band_b_found"] is False


@pytest.mark.parametrize("planted", [(0, 1, 2), (10, 11, 12)])
def test_one_missing_side_takes_its_best_signed_layers_outside_the_found_band(tmp_path, planted):
    profile = layer_profile(*_synthetic({layer: 1.0 for layer in planted}, seed=4), replicates=200)
    band_a, band_b = discover_bands(profile)
    assert band_a.layers == planted and band_b is None
    path = tmp_path / "c.json"
    calibration = write_band_calibration(path, model="m", profile=profile, band_a=band_a, band_b=band_b)
    outside = [layer for layer in range(LAYERS) if layer not in planted]
    most_negative = sorted(outside, key=lambda layer: profile.rho[layer])[:3]
    assert calibration.band_b == tuple(sorted(most_negative)) and calibration.b == most_negative[0]
    assert calibration.a in planted and not set(calibration.band_b) & set(planted)
    assert calibration.extra["band_b_found"] is False


def test_calibration_file_drives_epikv(tmp_path):
    import reasonkv

    if "epikv" not in reasonkv.list_policies():
        pytest.skip("the epikv policy is not installed")
    from reasonkv.policies.contract import ModelInfo

    profile = layer_profile(*_synthetic(PLANTED), replicates=200)
    band_a, band_b = discover_bands(profile)
    path = tmp_path / "calibration.json"
    write_band_calibration(path, model="synthetic", profile=profile, band_a=band_a, band_b=band_b)
    info = ModelInfo(num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=16)
    assert reasonkv.get_policy("epikv", calibration=str(path)).needs(info).hidden_layers == (5, 11)
    band = reasonkv.get_policy("epikv", calibration=str(path), variant="band").needs(info).hidden_layers
    assert band == (3, 4, 5, 6, 7, 10, 11, 12)
