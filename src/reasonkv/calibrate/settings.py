"""``reasonkv calibrate``'s settings: one frozen object, built by the command line or in Python, checked once;
each field carries its flag (:mod:`reasonkv.runs.flags`). :func:`reasonkv.calibrate.run.run_calibration` reads
nothing else."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasonkv.calibrate.labels import TARGETS, LabelSettings
from reasonkv.calibrate.profile import CONTROLS
from reasonkv.calibrate.shared import (
    ModelSettings,
    check_choices,
    check_positive,
    cut_setting,
    generation_setting,
    out_setting,
    progress_setting,
    traces_setting,
)
from reasonkv.calibrate.signals import SIGNALS, SignalSettings
from reasonkv.calibrate.traces import SOURCES
from reasonkv.runs.flags import nested, setting
from reasonkv.suggest.integers import check_int, is_number

__all__ = ["CalibrateSettings"]


@dataclass(frozen=True, kw_only=True)
class CalibrateSettings(ModelSettings):
    """Everything one ``reasonkv calibrate`` run is told: the model (checked when it loads: ``analyse_only``
    loads none), the traces (``traces`` problems of ``dataset`` in file order, ``source`` reference solutions or
    the model's greedy answers), the label and signal settings, how the bands are picked (``target``,
    ``signal``, ``control``, ``min_width``, ``max_width``) and scored (``top_fraction``, ``bootstrap``,
    ``seed``), and the ``out`` folder (reused to resume). Each field's flag says the rest."""

    traces: int = traces_setting(180)  # the committed anatomy's count (docs/anatomy): AUC intervals about +-0.04
    source: str = setting(
        "reference",
        group="traces",
        choices=SOURCES,
        help="teacher-force the reference solutions (default) or the model's own greedy answers",
    )
    max_trace_tokens: int | None = cut_setting()
    max_new_tokens: int = generation_setting(512)
    labels: LabelSettings = nested(LabelSettings)
    signals: SignalSettings = nested(SignalSettings)
    target: str = setting(
        "later",
        group="analysis",
        choices=TARGETS,
        help="label that picks the bands (default later: mean drop of the later tokens)",
    )
    signal: str = setting("z", group="analysis", choices=SIGNALS, help="z-scored (default) or raw g")
    control: str = setting(
        "position",
        group="analysis",
        choices=CONTROLS,
        help="partial out the chunk position from the correlations (default) or not",
    )
    min_width: int = setting(3, group="analysis", type="positive", help="shortest band (default 3 layers)")
    max_width: int = setting(8, group="analysis", type="positive", help="widest band (default 8 layers)")
    top_fraction: float = setting(0.2, group="analysis", type="fraction", help="positives of the AUC (default 0.2)")
    bootstrap: int = setting(1000, group="analysis", type="positive", help="trace resamples (default 1000)")
    seed: int = setting(0, group="analysis", type=int, help="bootstrap seed (default 0)")
    out: Path = out_setting()
    analyse_only: bool = setting(False, group="options", help="no model: analyse the records already in --out")
    progress: bool = progress_setting()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "out", Path(self.out))
        check_positive(self, "traces", "max_new_tokens", "min_width", "max_width", "bootstrap")
        if self.max_trace_tokens is not None:
            check_positive(self, "max_trace_tokens")
        check_choices(self)
        if not isinstance(self.labels, LabelSettings) or not isinstance(self.signals, SignalSettings):
            raise ValueError("labels and signals must be a LabelSettings and a SignalSettings")
        if not is_number(self.top_fraction):
            raise ValueError(f"top_fraction must be a number in (0, 1), got {self.top_fraction!r}")
        if not 0 < self.top_fraction < 1:
            raise ValueError(f"top_fraction must be in (0, 1), got {self.top_fraction}")
        check_int("seed", self.seed)
        if self.min_width > self.max_width:
            raise ValueError(f"min_width {self.min_width} is larger than max_width {self.max_width}")

    @property
    def targets(self) -> list[str]:
        """The label kinds reported: the one that picks the bands, then the answer's."""
        return list(dict.fromkeys([self.target, "answer"]))

    def record_settings(self) -> dict[str, Any]:
        """What every stored record depends on besides the label and signal settings."""
        read = {name: getattr(self, name) for name in ("model", "dtype", "dataset", "source", "max_trace_tokens")}
        return {**read, "max_new_tokens": self.max_new_tokens if self.source == "generated" else None}

    def command(self) -> str:
        """The command line that reproduces the run (settings at their default left out)."""
        parts = ["reasonkv", "calibrate", "--model", self.model, "--dataset", self.dataset]
        parts += ["--traces", str(self.traces), "--source", self.source, "--chunk-size", str(self.labels.chunk_size)]
        optional = {
            "dtype": self.dtype,
            "device": self.device,
            "horizon": self.labels.horizon,
            "max_trace_tokens": self.max_trace_tokens,
            "target": self.target,
            "signal": self.signal,
            "control": self.control,
            "window": self.signals.window,
            "batch_size": self.labels.batch_size,
            "bootstrap": self.bootstrap,
        }
        defaults = {f.name: f.default for f in dataclasses.fields(self)}  # the nested settings' fields flattened
        defaults.update(dataclasses.asdict(LabelSettings()), **dataclasses.asdict(SignalSettings()))
        for name, value in optional.items():
            if value != defaults[name]:
                parts += ["--" + name.replace("_", "-"), str(value)]
        if self.source == "generated":
            parts += ["--max-new-tokens", str(self.max_new_tokens)]
        return shlex.join([*parts, "--out", str(self.out)])
