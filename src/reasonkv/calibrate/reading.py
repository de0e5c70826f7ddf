"""What ``reasonkv calibrate --centers`` and ``--budgets`` share: the model, what it reads (a dataset's reference
solutions after their prompts, or one plain-text file) and the one file it writes (:class:`ReadingSettings`), and
the sequences read (:func:`read_sequences`); each command adds its own options and file kind.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from reasonkv.calibrate.shared import ModelSettings, cut_setting, out_setting, traces_setting
from reasonkv.calibrate.traces import reference_trace
from reasonkv.eval.datasets import load_dataset
from reasonkv.runs.flags import flags, option, setting
from reasonkv.suggest.integers import check_int

__all__ = ["TEXT_GROUP", "ReadingSettings", "read_sequences"]

TEXT_GROUP = "query centers (TriAttention)"  # where --text is shown: beside --centers, which reads it first


@dataclass(frozen=True, kw_only=True)
class ReadingSettings(ModelSettings):
    """The model, what it reads (the reference solutions of the first ``traces`` problems of ``dataset`` after
    their prompts, or the plain-text file ``text`` as one sequence; each cut to ``max_tokens``) and ``out``, the
    one file it writes (a new path, or a file of this command's kind, which is replaced)."""

    FLAG: ClassVar[str]  # the command's flag, e.g. "--centers"
    FILE_KIND: ClassVar[str]  # what ``out`` must hold if it exists, e.g. "query centers file"
    COUNTS: ClassVar[tuple[tuple[str, int], ...]] = ()  # the command's own integer options and their least values

    traces: int = traces_setting(100)
    text: Path | None = setting(
        None, group=TEXT_GROUP, type=Path, help="with --centers: a plain-text file to read instead of --dataset"
    )
    max_tokens: int | None = cut_setting()
    out: Path = out_setting()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "out", Path(self.out))
        if self.text is not None:
            object.__setattr__(self, "text", Path(self.text))
            if not self.text.is_file():
                raise ValueError(f"--text {str(self.text)!r} is not a file")
        for name, low in (("traces", 1), ("max_tokens", 1), *self.COUNTS):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, low)
        if self.out.is_dir():
            raise ValueError(f"--out {str(self.out)!r} is a folder; {self.FLAG} writes one file")
        if self.out.exists():
            try:
                self._load_existing(self.out)
            except ValueError:
                raise ValueError(
                    f"--out {str(self.out)!r} exists and is not a {self.FILE_KIND}; it is left untouched"
                ) from None

    def _load_existing(self, path: Path) -> None:
        """Raise ``ValueError`` unless ``path`` holds a file of this command's kind."""
        raise NotImplementedError

    @property
    def source(self) -> str:
        """What the command reads, as its file records it."""
        cut = f", at most {self.max_tokens} tokens each" if self.max_tokens else ""
        if self.text is not None:
            return f"text file {self.text.name}{cut}"
        return f"{self.dataset}: {self.traces} reference solutions after their prompts{cut}"

    def command(self) -> str:
        parts = ["reasonkv", "calibrate", self.FLAG, "--model", self.model]
        if self.dtype != "fp32":
            parts += ["--dtype", self.dtype]
        if self.text is not None:
            parts += ["--text", str(self.text)]
        else:
            parts += ["--dataset", self.dataset, "--traces", str(self.traces)]
        if self.max_tokens:
            parts += ["--max-trace-tokens", str(self.max_tokens)]
        spelled = {field.name: option(field, flag) for field, flag in flags(type(self))}
        own = [word for name, _ in self.COUNTS for word in (spelled[name], str(getattr(self, name)))]
        return shlex.join([*parts, *own, "--out", str(self.out)])


def read_sequences(settings: ReadingSettings, tokenizer) -> list[list[int]]:
    """The token id sequences ``settings`` names: the text file, or each reference solution after its prompt."""
    if settings.text is not None:
        ids = tokenizer(settings.text.read_text(encoding="utf-8"))["input_ids"]
        ids = list(ids[: settings.max_tokens] if settings.max_tokens else ids)
        if not ids:
            raise ValueError(f"--text {str(settings.text)!r} holds no tokens")
        return [ids]
    problems = [p for p in load_dataset(settings.dataset) if p.solution][: settings.traces]
    if not problems:
        raise ValueError(f"dataset {settings.dataset!r} has no reference solutions; pass --text FILE")
    traces = [reference_trace(tokenizer, p) for p in problems]
    return [t.ids[: settings.max_tokens] if settings.max_tokens else t.ids for t in traces]
