"""What the calibrations share: the model, how it loads and the dataset it reads (:class:`ModelSettings`), and
the flags several of them declare for their own fields (``reasonkv calibrate`` adds each once)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasonkv.models import DEFAULT_MODEL, load_model
from reasonkv.runs.flags import flags, setting
from reasonkv.suggest.integers import check_int

__all__ = [
    "ModelSettings",
    "check_choices",
    "check_positive",
    "cut_setting",
    "generation_setting",
    "out_setting",
    "progress_setting",
    "traces_setting",
]


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """The model to load (``model``, ``dtype``, ``device``, ``attn``) and ``dataset``, a bundled dataset name or a
    JSONL path."""

    model: str = setting(DEFAULT_MODEL, group="model", shared="model")
    dtype: str = setting("fp32", group="model", shared="model")
    device: str = setting("cpu", group="model", shared="model")
    attn: str = setting("sdpa", group="model", shared="model")
    dataset: str = setting("gsm8k", group="traces", help="bundled dataset name or JSONL path (default gsm8k)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", os.fspath(self.model))
        object.__setattr__(self, "dataset", os.fspath(self.dataset))

    def load(self, *, progress: bool | None = None) -> tuple[Any, Any]:
        """The model and its tokenizer, loaded as the settings say (announced on stderr)."""
        print(f"loading {self.model} ({self.dtype}, {self.device}, {self.attn}) ...", file=sys.stderr, flush=True)
        return load_model(
            self.model, dtype=self.dtype, device=self.device, attn_implementation=self.attn, progress=progress
        )


def check_positive(settings: Any, *names: str) -> None:
    """Refuse a setting among ``names`` of ``settings`` that is not a positive integer."""
    for name in names:
        check_int(name, getattr(settings, name), 1)


def check_choices(settings: Any) -> None:
    """Refuse a setting of ``settings`` whose flag lists ``choices`` that does not hold one of them."""
    for field, flag in flags(type(settings)):
        value = getattr(settings, field.name)
        if flag.choices is not None and value not in flag.choices:
            raise ValueError(f"{field.name} must be one of {', '.join(flag.choices)}, got {value!r}")


def traces_setting(default: int) -> Any:
    """``--traces``: how many problems are read, in file order."""
    help = f"number of problems, in file order (default {default})"
    return setting(default, group="traces", type="positive", help=help)


def cut_setting() -> Any:
    """``--max-trace-tokens``: every trace cut to this many tokens (None: whole)."""
    return setting(
        None, group="traces", name="--max-trace-tokens", type="positive or all", help="cut traces to this many tokens"
    )


def generation_setting(default: int) -> Any:
    """``--max-new-tokens``: the longest answer the model generates."""
    return setting(default, group="traces", type="positive", help="generation length for --source generated")


def out_setting() -> Any:
    """``--out``: where the calibration writes (required)."""
    help = "output folder (reused to resume); a file with --centers"
    return setting(group="options", type=Path, required=True, help=help)


def progress_setting() -> Any:
    """``--no-progress``: no progress bar."""
    return setting(True, group="options", negated=True, help="no progress bar")
