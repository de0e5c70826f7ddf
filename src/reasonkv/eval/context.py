"""What the phases of a grid share: what a run's files hold (:class:`Ledger`), each unit's identity (the record
its result starts from) and where records go (:class:`Context`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from tqdm.auto import tqdm

from reasonkv.cache.quantize import QuantFormat, default_group_size
from reasonkv.cache.tiers import equivalent_budget
from reasonkv.eval.code import CodeGrader
from reasonkv.eval.datasets import Problem
from reasonkv.eval.grid import Cell, GridSpec
from reasonkv.eval.prompts import build_prompt
from reasonkv.eval.record_kinds import ErrorRecord, FidelityRecord, GenerationRecord, Record, UnitRecord
from reasonkv.eval.records import ResultsFile, conflict
from reasonkv.generation.context import context_length
from reasonkv.generation.inputs import encode_prompt
from reasonkv.hf import model_info

__all__ = ["Context", "Ledger", "attempt", "chunks", "now", "progress", "reason"]


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def chunks(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def progress(total: int, desc: str, enabled: bool):
    # Redrawn often on a terminal; every 30 s in a log file.
    interval = 0.5 if sys.stderr.isatty() else 30.0
    return tqdm(
        total=total, desc=desc, unit="rec", dynamic_ncols=True, mininterval=interval, disable=not enabled or total == 0
    )


def reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def attempt(run: Callable[[list], list], batch: list) -> list[tuple[Any, Any]]:
    """``[(item, output or exception)]``: the batch at once, or, if that fails, each item alone."""
    try:
        return list(zip(batch, run(batch), strict=True))
    except Exception as error:  # noqa: BLE001 - one failing unit must not cost the others their results
        if len(batch) == 1:
            return [(batch[0], error)]
        return [pair for item in batch for pair in attempt(run, [item])]


@dataclass
class Ledger:
    """What a run's files hold: finished units (with their grade), failed units, greedy full-cache traces."""

    retry_errors: bool = False
    results: dict[tuple, bool | None] = field(default_factory=dict)  # unit -> correct (None: fidelity)
    errors: dict[tuple, str] = field(default_factory=dict)  # unit -> reason
    traces: dict[tuple[str, str], tuple[list[int], str | None]] = field(default_factory=dict)
    outcomes: dict[tuple, dict[str, Any]] = field(default_factory=dict)  # unit -> what its result says
    conflicts: dict[tuple, list[str]] = field(default_factory=dict)  # unit -> the fields two results differ in

    def note(self, record: Record | dict[str, Any]) -> None:
        record = record if isinstance(record, Record) else Record.read(record)
        if not isinstance(record, UnitRecord):
            return
        key = record.key()
        if not record.result:
            self.errors[key] = str(record.error)
            return
        said = record.outcome()
        if key in self.outcomes and key not in self.conflicts:
            differs = conflict(self.outcomes[key], said)
            if differs:  # the run is settled either way; say so, as `report` will (it leaves the unit out)
                self.conflicts[key] = differs
                print(
                    f"warning: two results of {record.named()} differ in {', '.join(differs)}; "
                    "reasonkv report leaves the unit out of its numbers",
                    file=sys.stderr,
                )
        self.outcomes.setdefault(key, said)
        self.results[key] = record.correct if isinstance(record, GenerationRecord) else None
        if isinstance(record, GenerationRecord) and record.greedy_full_trace:
            self.traces[(record.dataset, record.problem_id)] = (record.output_ids, record.finish_reason)

    def settled(self, key: tuple) -> bool:
        """Whether a unit needs no work: it has a result, or an error record and errors are not retried."""
        return key in self.results or (key in self.errors and not self.retry_errors)

    def recorded(self, key: tuple) -> bool:
        """Whether a unit has a record, result or error (a grid is complete when all have one)."""
        return key in self.results or key in self.errors

    def failed(self, key: tuple) -> bool:
        return key in self.errors and key not in self.results


@dataclass
class Context:
    """Everything the phases share: the model, the grid, where records go and what is done."""

    model: Any
    tokenizer: Any
    grid: GridSpec
    model_name: str
    dtype: str
    device: str
    prompt_format: str
    progress: bool = True
    on_record: Callable[[dict], None] | None = None
    run_id: str = ""
    label: str = ""  # shown in progress bars ("[1/4] ")
    ledger: Ledger = field(default_factory=Ledger)
    results: ResultsFile | None = None
    grader: CodeGrader | None = None  # when the grid has code problems
    counts: dict[str, int] = field(default_factory=lambda: {"generation": 0, "fidelity": 0, "error": 0, "skipped": 0})
    tally: dict[str, list[int]] = field(default_factory=dict)  # "dataset cell" -> [correct, total]
    fidelity_tally: dict[str, list[float]] = field(default_factory=dict)  # "dataset cell" -> [Σ top-1, Σ KL, n]
    _prompts: dict = field(default_factory=dict)
    _told: set = field(default_factory=set)  # errors printed (a problem's generation and fidelity fail alike)

    def prompt_ids(self, problem: Problem) -> list[int]:
        key = (problem.id, problem.kind, problem.problem)  # ids may repeat across user files
        if key not in self._prompts:
            ids = encode_prompt(self.tokenizer, build_prompt(self.tokenizer, problem, thinking=self.grid.thinking))
            if not ids:
                raise ValueError(f"problem {problem.id!r}: empty prompt")
            self._prompts[key] = ids
        return self._prompts[key]

    def _base(self, kind: str, dataset: str, problem: Problem, cell: Cell) -> dict[str, Any]:
        # An allocation other than uniform is part of the unit (absent for uniform: older records keep their keys).
        allocation = cell.spec.allocation_rule.record()
        return {
            "kind": kind,
            "model": self.model_name,
            "dtype": self.dtype,
            "device": self.device,
            "dataset": dataset,
            "problem_id": problem.id,
            "policy": cell.policy,
            "policy_label": cell.label,
            "policy_config": cell.config,
            "budget": cell.budget,
            "buffer": cell.buffer,
            "tier": self.tier(cell),
            **allocation,
            "base_seed": self.grid.seed,
            "prompt_format": self.prompt_format,
        }

    @property
    def context(self) -> int | None:
        """The model's context length (``max_position_embeddings``), when its config says."""
        return context_length(self.model)

    def tier(self, cell: Cell) -> dict[str, int] | None:
        """The cell's quantized tier as recorded (with the group size it gets on this model), or None."""
        if not cell.quantized:
            return None
        group_size = cell.spec.group_size or default_group_size(model_info(self.model).head_dim)
        return {"quantized": cell.quantized, "bits": cell.bits, "group_size": group_size}

    def equivalent_budget(self, cell: Cell) -> float | None:
        """The full-precision budget with the cell's nominal K/V bytes (its budget without a tier)."""
        if not cell.quantized:
            return cell.budget
        tier = self.tier(cell)
        size = next(self.model.parameters()).element_size()
        fmt = QuantFormat(tier["bits"], tier["group_size"])
        return round(equivalent_budget(cell.budget, cell.quantized, fmt, model_info(self.model).head_dim, size), 2)

    def generation_key(self, dataset: str, problem: Problem, cell: Cell, sample: int) -> GenerationRecord:
        """The identity of a generation unit: the record its result starts from."""
        sampling = dataclasses.asdict(self.grid.sampling)  # the record's SAMPLING fields
        return GenerationRecord(
            {**self._base(GenerationRecord.kind, dataset, problem, cell), "sample": sample, **sampling}
        )

    def fidelity_key(self, dataset: str, problem: Problem, cell: Cell) -> FidelityRecord:
        """The identity of a fidelity unit: the record its result starts from."""
        return FidelityRecord(
            {**self._base(FidelityRecord.kind, dataset, problem, cell), "fidelity_tokens": self.grid.replay_tokens}
        )

    def note_fidelity(self, dataset: str, cell: Cell, said: dict[str, Any] | None) -> None:
        """Add what a fidelity result says (its record's outcome) to its cell's tally."""
        top1, kl = (said or {}).get("top1_agreement"), (said or {}).get("kl_mean")
        if isinstance(top1, (int, float)) and isinstance(kl, (int, float)):
            tally = self.fidelity_tally.setdefault(f"{dataset} {cell.name}", [0.0, 0.0, 0])
            tally[0], tally[1], tally[2] = tally[0] + top1, tally[1] + kl, tally[2] + 1

    def emit(self, record: UnitRecord) -> None:
        self.results.append(record)
        self.ledger.note(record)
        self.counts[record.kind] += 1
        if self.on_record is not None:
            self.on_record(record.to_json())

    def error(self, key: UnitRecord, why: str, stage: str, seed: int | None = None) -> None:
        """Write the error record of the unit ``key`` describes."""
        record = ErrorRecord.of(key, seed=seed, stage=stage, error=why, run=self.run_id, time=now())
        told = (key.dataset, key.problem_id, key.policy_label, key.budget, why)
        if told not in self._told:  # the fidelity unit of a problem whose generation failed alike: said once
            self._told.add(told)
            print(f"{self.label}error: {key.named()}: {why}", file=sys.stderr, flush=True)
        self.emit(record)
