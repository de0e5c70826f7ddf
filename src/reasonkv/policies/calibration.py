"""Layer anatomy for EPIKV: which decoder layers carry the "important" and the "filler" signal.

The EPIKV paper found, on a 32-layer model, that a large change of the residual stream in layers
7..13 (band A) marks an important token and a large change in layers 18..25 (band B) marks
predictable filler; its two-layer score reads layer 10 (``a``) against layer 21 (``b``). For a model
of another depth the indices are scaled by ``L / 32`` (:func:`default_anatomy`). A measured anatomy
is stored in a small JSON file (:func:`write_calibration`, :func:`load_calibration`)::

    {"model": "smollm2-135m", "num_layers": 30, "a": 9, "b": 20,
     "band_a": [7, 8, 9, 10, 11, 12], "band_b": [17, 18, 19, 20, 21, 22, 23]}

Extra keys (for example the per-layer correlations a calibration run measured) are allowed and
kept in :attr:`Calibration.extra`. Layers are counted from 0 (the first decoder layer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from reasonkv.suggest.integers import check_int, is_int

__all__ = [
    "REFERENCE_DEPTH",
    "Calibration",
    "check_layers",
    "default_anatomy",
    "scale_layer",
    "load_calibration",
    "write_calibration",
]

REFERENCE_DEPTH = 32  # depth of the model the paper's layer anatomy was measured on
_REFERENCE_A, _REFERENCE_B = 10, 21
_REFERENCE_BAND_A = (7, 13)  # inclusive
_REFERENCE_BAND_B = (18, 25)
_REQUIRED = {"model": str, "num_layers": int, "a": int, "b": int, "band_a": list, "band_b": list}


@dataclass(frozen=True)
class Calibration:
    """The layers EPIKV reads for one model depth.

    ``a``/``b``: the two layers of the ``raw``/``zscore``/``lag`` scores; ``band_a``/``band_b``: the
    layers averaged by the ``band`` score. ``model`` names what the file was measured on (for
    people; only ``num_layers`` is checked against the model).
    """

    num_layers: int
    a: int
    b: int
    band_a: tuple[int, ...]
    band_b: tuple[int, ...]
    model: str = ""
    extra: Mapping[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1)
        object.__setattr__(self, "band_a", tuple(self.band_a))
        object.__setattr__(self, "band_b", tuple(self.band_b))
        for name in ("a", "b", "band_a", "band_b"):
            check_layers(name, getattr(self, name), self.num_layers)

    def write(self, path: str | os.PathLike) -> Calibration:
        """Write this anatomy as a calibration file (parent folders are created); returns it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        return self

    def as_dict(self) -> dict[str, object]:
        """The JSON form (schema of the module docstring, extra keys last)."""
        fields = {key: getattr(self, key) for key in _REQUIRED}
        fields.update(band_a=list(self.band_a), band_b=list(self.band_b))
        return {**fields, **{k: v for k, v in self.extra.items() if k not in _REQUIRED}}


def check_layers(name: str, value: int | Iterable[int], num_layers: int, *, owner: str = "") -> None:
    """Raise a ``ValueError`` naming ``name`` and the model depth unless every index is in ``0..L-1``."""
    prefix = f"{owner}: " if owner else ""
    indices = (value,) if is_int(value) else tuple(value)
    if not indices:
        raise ValueError(f"{prefix}{name} must name at least one layer")
    for index in indices:
        if not is_int(index):
            raise ValueError(f"{prefix}{name} must hold integer layer indices, got {value!r}")
        if not 0 <= index < num_layers:
            raise ValueError(
                f"{prefix}{name}={value!r} is out of range: the model has {num_layers} decoder layers "
                f"(valid indices 0..{num_layers - 1})"
            )


def scale_layer(index: int, num_layers: int, reference: int = REFERENCE_DEPTH) -> int:
    """``round(index * num_layers / reference)`` (halves round up), clamped to ``0..num_layers-1``.

    Integer arithmetic, so the result never depends on floating-point rounding: for a 30-layer model
    10 -> 9, 21 -> 20, 7 -> 7, 13 -> 12, 18 -> 17, 25 -> 23.
    """
    scaled = (2 * index * num_layers + reference) // (2 * reference)
    return min(max(scaled, 0), num_layers - 1)


def default_anatomy(num_layers: int) -> Calibration:
    """The paper's 32-layer anatomy scaled to ``num_layers`` (band end points scaled, bands inclusive)."""

    def band(ends: tuple[int, int]) -> tuple[int, ...]:
        lo, hi = (scale_layer(e, num_layers) for e in ends)
        return tuple(range(lo, hi + 1))

    return Calibration(
        num_layers=num_layers,
        a=scale_layer(_REFERENCE_A, num_layers),
        b=scale_layer(_REFERENCE_B, num_layers),
        band_a=band(_REFERENCE_BAND_A),
        band_b=band(_REFERENCE_BAND_B),
        model=f"scaled from the {REFERENCE_DEPTH}-layer anatomy",
    )


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read and validate a calibration file; every problem is a ``ValueError`` naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"calibration file {str(path)!r} is not readable JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    missing = sorted(set(_REQUIRED) - set(data))
    if missing:
        raise ValueError(
            f"calibration file {str(path)!r} lacks {', '.join(missing)}; required keys: {', '.join(_REQUIRED)}"
        )
    for key, kind in _REQUIRED.items():
        value = data[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"calibration file {str(path)!r}: {key} must be a JSON {_json_kind(kind)}, got {value!r}")
    try:
        fields = {key: tuple(data[key]) if kind is list else data[key] for key, kind in _REQUIRED.items()}
        return Calibration(**fields, extra={k: v for k, v in data.items() if k not in _REQUIRED})
    except ValueError as error:
        raise ValueError(f"calibration file {str(path)!r}: {error}") from None


def write_calibration(path: str | os.PathLike, *, model: str, extra=None, **layers) -> Calibration:
    """Validate and write a calibration file of the ``num_layers``, ``a``, ``b``, ``band_a`` and ``band_b`` given,
    with ``extra`` keys (parent folders are created). Returns what was written."""
    return Calibration(**layers, model=str(model), extra=dict(extra or {})).write(path)


def _json_kind(kind: type) -> str:
    return {str: "string", int: "integer", list: "list of integers"}[kind]
