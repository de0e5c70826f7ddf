"""The kinds of record a results file holds, one class each, and the one place a line's ``kind`` is read.

A record keeps its JSON object as written. Its class says which fields identify its unit of work (``KEY``:
a rerun skips a key on disk), what its result says (``OUTCOME``: two results of one unit that differ here
conflict) and the types of the fields read back (``TYPES``, each also an attribute).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from reasonkv.eval.manifest import manifest_problem, shown

__all__ = [
    "KINDS",
    "SAMPLING",
    "UNITS",
    "Check",
    "ErrorRecord",
    "FidelityRecord",
    "GenerationRecord",
    "ManifestRecord",
    "Record",
    "UnitRecord",
]


@dataclass(frozen=True)
class Check:
    """The type a field must have when it is there and not null, and what to say when it has not."""

    types: tuple[type, ...]
    what: str
    smallest: float | None = None
    largest: float | None = None

    def fails(self, value: Any) -> bool:
        if (isinstance(value, bool) and bool not in self.types) or not isinstance(value, self.types):
            return True
        too_small = self.smallest is not None and value < self.smallest
        return too_small or (self.largest is not None and value > self.largest)


_TEXT = Check((str,), "a string")
_OBJECT = Check((dict,), "an object")
_INTEGER = Check((int,), "an integer")
_NUMBER = Check((int, float), "a number")
_FLAG = Check((bool,), "true or false")
_POSITIVE = Check((int,), "a positive integer", 1)
_COUNT = Check((int,), "a non-negative integer", 0)


def _canonical(value: Any) -> Any:
    """A hashable form of a JSON value (dicts sorted, lists as tuples, floats normalised)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return int(value)  # 0.0 and 0 are the same setting once written to JSON
    return value


def _jsonable(value: Any) -> Any:
    # Keys are compared between records read back from JSON and records about to be written, so
    # both go through the same conversion (tuples become lists, non-JSON values become strings).
    return json.loads(json.dumps(value, default=str))


@dataclass(frozen=True)
class Record:
    """One line of a results file: its JSON object, as written."""

    data: dict[str, Any]

    kind: ClassVar[str] = ""
    TYPES: ClassVar[dict[str, Check]] = {}
    #: The kind of record that completes the unit of work this one is about (None: about no unit).
    unit: ClassVar[str | None] = None
    #: Whether the record holds a result (an error record settles its unit without one).
    result: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.TYPES:  # each typed field reads as an attribute
            if name not in vars(cls):
                setattr(cls, name, property(lambda self, name=name: self.data.get(name)))

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Record:
        """The record of ``data``'s kind; ``ValueError`` saying what is wrong with a line that is not a sound one."""
        cls = KINDS.get(data.get("kind")) if isinstance(data.get("kind"), str) else None
        if cls is None:
            raise ValueError(f"field 'kind' must be one of {', '.join(KINDS)}, got {shown(data.get('kind'))}")
        record = cls(dict(data))
        problem = record.problem()
        if problem is not None:
            raise ValueError(problem)
        return record

    @staticmethod
    def read(data: dict[str, Any]) -> Record:
        """The record of a line already checked (:meth:`from_json`), holding ``data`` itself."""
        return KINDS[data["kind"]](data)

    def to_json(self) -> dict[str, Any]:
        return self.data

    def with_fields(self, **fields: Any) -> Record:
        """This record with ``fields`` set (a field it holds keeps its place, a new one comes last)."""
        return type(self)({**self.data, **fields})

    def get(self, name: str, default: Any = None) -> Any:
        return self.data.get(name, default)

    def problem(self) -> str | None:
        """What is wrong with this record (a hand edit), in words; None when it is sound."""
        for name, check in self.TYPES.items():
            value = self.data.get(name)
            if value is not None and check.fails(value):
                return f"field '{name}' must be {check.what} (or null), got {shown(value)}"
        return None


class ManifestRecord(Record):
    """What the records after it were computed with (:mod:`reasonkv.eval.manifest`)."""

    kind = "manifest"

    def problem(self) -> str | None:
        if self.data.get("tool") != "reasonkv":
            return f"a manifest of {self.data.get('tool')!r}, not of reasonkv"
        return manifest_problem(self.data)


#: The fields every unit's record holds, with their types (identity first, in the order records write them).
_UNIT_TYPES = {
    "model": _TEXT,
    "dtype": _TEXT,
    "dataset": _TEXT,
    "problem_id": Check((str, int), "a string"),
    "prompt_format": _TEXT,
    "policy": _TEXT,
    "policy_label": _TEXT,
    "policy_config": _OBJECT,
    "budget": _POSITIVE,
    "buffer": _COUNT,
    "tier": _OBJECT,
    "allocation": _TEXT,
    "base_seed": _INTEGER,
    "seed": _INTEGER,
    "run": _TEXT,
}
#: The decoding settings a generation record holds, as its run manifest's setup names them.
SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k")
_CELL = ("model", "dtype", "dataset", "problem_id", "policy_config", "budget", "buffer", "tier", "allocation")


class UnitRecord(Record):
    """The result of one unit of work (or, for :class:`ErrorRecord`, why there is none)."""

    KEY: ClassVar[tuple[str, ...]] = ()
    OUTCOME: ClassVar[tuple[str, ...]] = ()
    result = True

    def key(self) -> tuple:
        """The unit of work: ``(unit, *values of KEY)``, missing fields as ``None``."""
        return (self.kind, *(_canonical(_jsonable(self.data.get(name))) for name in self.KEY))

    def outcome(self) -> dict[str, Any]:
        """What the result says (``OUTCOME``), ``output_ids`` as a SHA-256 (readers keep outcomes, not tokens)."""
        said = {name: self.data.get(name) for name in self.OUTCOME}
        if isinstance(said.get("output_ids"), list):
            said["output_ids"] = hashlib.sha256(json.dumps(said["output_ids"]).encode()).hexdigest()
        return said

    def named(self) -> str:
        """``dataset problem label@budget``, as messages name a unit."""
        budget = "" if self.budget is None else f"@{self.budget}"
        return f"{self.data.get('dataset')} {self.data.get('problem_id')} {self.data.get('policy_label')}{budget}"


class GenerationRecord(UnitRecord):
    """One decoded and graded sample (:mod:`reasonkv.eval.decoding`)."""

    kind = unit = "generation"
    KEY = (*_CELL, "sample", "base_seed", *SAMPLING, "prompt_format")
    # The tokens are compared too: a record copied from another unit and relabelled may grade alike.
    OUTCOME = ("correct", "extracted_answer", "grading_method", "finish_reason", "output_ids")
    TYPES = {
        **_UNIT_TYPES,
        "sample": _COUNT,
        "max_new_tokens": _POSITIVE,
        "temperature": _NUMBER,
        "top_p": _NUMBER,
        "top_k": _INTEGER,
        "correct": _FLAG,
        "output_ids": Check((list,), "a list"),
        "output_tokens": _INTEGER,
        "tokens_per_second": _NUMBER,
        "extracted_answer": _TEXT,
        "grading_method": _TEXT,
        "finish_reason": _TEXT,
        "collapse": _OBJECT,
        "collapsed": _FLAG,
    }

    @property
    def greedy_full_trace(self) -> bool:
        """Whether this is the greedy full-cache trace of its problem (the tokens fidelity replays)."""
        ids = self.data.get("output_ids")
        greedy = self.data.get("temperature") == 0 and self.data.get("sample") == 0
        return self.data.get("policy") == "full" and greedy and isinstance(ids, list) and bool(ids)

    def problem(self) -> str | None:
        if not isinstance(self.data.get("correct"), bool):
            return f"field 'correct' must be true or false, got {shown(self.data.get('correct'))}"
        return super().problem()


class FidelityRecord(UnitRecord):
    """One replay of the greedy full-cache trace under an evicting cell (:mod:`reasonkv.eval.replays`)."""

    kind = unit = "fidelity"
    KEY = (*_CELL, "base_seed", "fidelity_tokens", "prompt_format")
    OUTCOME = ("top1_agreement", "kl_mean", "answer_logprob_delta")
    TYPES = {
        **_UNIT_TYPES,
        "fidelity_tokens": _POSITIVE,
        "top1_agreement": Check((int, float), "a number between 0 and 1", 0, 1),
        "kl_mean": _NUMBER,
        "answer_logprob_delta": _NUMBER,
        "answer_logprob_delta_mean": _NUMBER,
    }


class ErrorRecord(UnitRecord):
    """A unit that could not be computed: its identity fields, ``unit`` (the kind of record it would have
    been), ``stage`` and ``error`` (the reason)."""

    kind = "error"
    TYPES = {**_UNIT_TYPES, "error": _TEXT}
    result = False

    @classmethod
    def of(cls, unit: UnitRecord, **fields: Any) -> ErrorRecord:
        """The error record of the unit whose identity ``unit`` holds (``fields``: seed, stage, error, run, time)."""
        identity = {k: v for k, v in unit.data.items() if k != "kind"}
        return cls({"kind": "error", **identity, "unit": unit.kind, **fields})

    @property
    def unit(self) -> str:  # type: ignore[override]
        return self.data.get("unit")

    def about(self) -> UnitRecord:
        """The record of the unit's kind with this record's fields (its identity)."""
        return UNITS[self.unit](self.data)

    def key(self) -> tuple:
        return self.about().key()

    def outcome(self) -> dict[str, Any]:
        return {}

    def problem(self) -> str | None:
        if self.unit not in UNITS:
            return f"field 'unit' must be one of {', '.join(UNITS)}, got {shown(self.unit)}"
        if not isinstance(self.error, str):
            return f"field 'error' must be the reason, a string, got {shown(self.error)}"
        return Record.problem(self.about())  # the types of the fields of the unit it names


#: Every record kind a results file may hold, by its ``kind``: the one place a line's kind is read.
KINDS: dict[str, type[Record]] = {c.kind: c for c in (ManifestRecord, GenerationRecord, FidelityRecord, ErrorRecord)}
#: The kinds of record that complete a unit of work.
UNITS: dict[str, type[UnitRecord]] = {c.kind: c for c in (GenerationRecord, FidelityRecord)}
