"""The numbers of ``reasonkv report``: results files read into one record per unit, then sections and rows.

One record per unit: a result replaces an error record, the latest error record wins, the same result twice
counts once, and two results that differ are a *conflict*, left out of every number and listed. A
:class:`Section` is one model, dataset and setup (its run manifest's); a :class:`Row` one (policy, budget)
of a section. The columns: :data:`reasonkv.eval.report.LEGEND`.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from reasonkv.eval.code_report import code_summary
from reasonkv.eval.collapse import stopped_early
from reasonkv.eval.grading import counts_as_correct, cut_off_guess
from reasonkv.eval.record_kinds import KINDS, SAMPLING, FidelityRecord, GenerationRecord, ManifestRecord, Record
from reasonkv.eval.records import conflict, read_results
from reasonkv.eval.shards import shard_files
from reasonkv.suggest.integers import is_number

__all__ = [
    "MIN_PAIRED",
    "Conflict",
    "ReportInput",
    "Row",
    "Section",
    "load_results",
    "mean_interval",
    "paired_interval",
    "pass_at_k",
    "read_report_input",
    "run_files",
    "section_names",
    "summarize",
    "wilson_interval",
]

Z95 = 1.959963984540054
#: Fewest paired problems a bootstrap interval of ``Δ vs full`` is given for.
MIN_PAIRED = 10


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (``(nan, nan)`` when ``total == 0``)."""
    if total <= 0:
        return math.nan, math.nan
    p = correct / total
    denom = 1 + z * z / total
    center = (p + z * z / (2 * total)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    return max(0.0, center - half), min(1.0, center + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct of ``n`` samples: ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def paired_interval(differences: Sequence[float], replicates: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the mean of per-problem differences (resampling problems)."""
    import numpy as np

    values = np.asarray(differences, dtype=float)
    if values.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(replicates, values.size))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(low), float(high)


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean with a 95% normal interval (``nan`` bounds for fewer than 2 values)."""
    finite = [float(v) for v in values if is_number(v) and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, math.nan, math.nan
    half = z * statistics.stdev(finite) / math.sqrt(len(finite))
    return mean, mean - half, mean + half


def _mean(values: Iterable[Any]) -> float:
    return mean_interval(list(values))[0]


def finite(value: Any) -> bool:
    """Whether ``value`` is a finite number (a record's field may be missing, null or NaN)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def average(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass
class Conflict:
    """A unit with two results that differ: left out of the numbers, listed in the report."""

    record: dict[str, Any]  # the first result read (names the unit)
    places: list[str]  # "file, line N" of every result of the unit
    fields: list[str]  # what the results differ in


@dataclass
class ReportInput:
    """What a report reads: one record per unit (conflicting units left out), the manifests, the conflicts."""

    records: list[dict[str, Any]]
    manifests: list[dict[str, Any]]
    conflicts: list[Conflict]


def run_files(path: str | os.PathLike[str]) -> list[Path]:
    """A results file (when it exists) and its shard files; ``FileNotFoundError`` when there is neither."""
    path = Path(path)
    files = ([path] if path.is_file() else []) + [p for p, _ in shard_files(path)]
    if not files:
        raise FileNotFoundError(f"no such results file: {path}")
    return files


def read_report_input(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *, drop: Sequence[str] = ()
) -> ReportInput:
    """Read results files and their shard files (see the module docstring); ``drop`` names fields left out
    of every record (a report needs neither ``output_ids`` nor ``output_text``)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    kept: dict[tuple, tuple[Record, str, dict[str, Any]]] = {}  # unit -> record, "file, line N", what it says
    conflicts: dict[tuple, Conflict] = {}
    manifests: dict[Any, dict[str, Any]] = {}
    for path in paths:
        for file in run_files(path):
            for number, record in read_results(file):
                place = f"{file}, line {number}"
                if isinstance(record, ManifestRecord):
                    manifests.setdefault(record.get("id"), record.to_json())
                    continue
                key, says = record.key(), record.outcome()
                for name in drop:
                    record.data.pop(name, None)
                held = kept.get(key)
                if key in conflicts:
                    if record.result:
                        conflicts[key].places.append(place)
                elif held is None or not held[0].result:
                    kept[key] = (record, place, says)
                elif record.result:
                    differs = conflict(held[2], says)
                    if differs:
                        conflicts[key] = Conflict(held[0].to_json(), [held[1], place], differs)
                        del kept[key]
                    else:  # the same result: the later record (its timings) stands for it
                        kept[key] = (record, place, says)
    records = [record.to_json() for record, _, _ in kept.values()]
    return ReportInput(records, list(manifests.values()), list(conflicts.values()))


def load_results(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *, drop: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Records of results files and their shard files, one per unit, then their manifests
    (:func:`read_report_input` without the conflicts)."""
    read = read_report_input(paths, drop=drop)
    return read.records + read.manifests


@dataclass(frozen=True)
class Section:
    """One model, one dataset, one setup (``None``: not known, for records written before manifests)."""

    model: str
    dataset: str
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    dtype: str | None = None
    prompt_format: str | None = None
    seed: int | None = None
    weights: str | None = None  # the first 12 hex digits of the weights' SHA-256 (from the run manifest)

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("model", "dataset")}

    def describe(self, extra: Sequence[str] = ()) -> str:
        """``dataset · model (max N new tokens; temperature T ...)``, with the ``extra`` settings named."""
        settings = []
        if self.max_new_tokens is not None:
            settings.append(f"max {self.max_new_tokens} new tokens")
        if self.temperature is not None:
            sampling = f"temperature {self.temperature:g}"
            if self.temperature > 0 and self.top_p not in (None, 1.0):
                sampling += f", top-p {self.top_p:g}"
            if self.temperature > 0 and self.top_k:
                sampling += f", top-k {self.top_k}"
            settings.append(sampling)
        settings += [f"{name.replace('_', ' ')} {getattr(self, name)}" for name in extra if name in _EXTRA]
        return f"{self.dataset} · {self.model}" + (f" ({'; '.join(settings)})" if settings else "")


_EXTRA = ("dtype", "prompt_format", "seed", "weights")
_SLUG = {"max_new_tokens": "max", "temperature": "t", "top_p": "p", "top_k": "k", "seed": "seed", "weights": "w"}


def section_names(sections: Sequence[Section]) -> dict[Section, tuple[str, str]]:
    """``section -> (title, file-name stem)``: sections of one model and dataset are told apart by what differs."""
    groups: dict[tuple[str, str], list[Section]] = {}
    for section in sections:
        groups.setdefault((section.model, section.dataset), []).append(section)
    names: dict[Section, tuple[str, str]] = {}
    for (model, dataset), members in groups.items():
        differing = [name for name in (*SAMPLING, *_EXTRA) if len({getattr(s, name) for s in members}) > 1]
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{Path(dataset).stem}-{Path(model).name}").strip("_")
        for section in members:
            extra = [name for name in differing if name in _EXTRA]
            parts = [f"{_SLUG.get(name, '')}{getattr(section, name)}" for name in differing]
            stem = "-".join([base, *(re.sub(r"[^A-Za-z0-9.]+", "_", p).strip("_") for p in parts)])
            names[section] = (section.describe(extra), stem)
    stems: dict[str, int] = {}
    for section, (title, stem) in names.items():  # what no setting tells apart gets a number
        stems[stem] = stems.get(stem, 0) + 1
        if stems[stem] > 1:
            names[section] = (title, f"{stem}-{stems[stem]}")
    return names


def _setup_section(record: Record, manifests: dict[Any, dict[str, Any]]) -> Section | None:
    """The section of the run that wrote ``record`` (its manifest's setup), or of its own generation settings;
    ``None`` for a fidelity record without a manifest."""
    model, dataset = str(record.get("model")), str(record.get("dataset"))
    setup = (manifests.get(record.get("run")) or {}).get("setup")
    if isinstance(setup, dict):
        weights = setup.get("weights_sha256")
        settings = {name: setup.get(name) for name in (*SAMPLING, "dtype", "prompt_format", "seed")}
        return Section(model, dataset, **settings, weights=str(weights)[:12] if weights else None)
    if record.unit != GenerationRecord.kind:
        return None
    settings = {name: record.get(name) for name in (*SAMPLING, "dtype", "prompt_format")}
    return Section(model, dataset, **settings, seed=record.get("base_seed"))


def _sections_of(records: Sequence[Record], manifests: dict[Any, dict[str, Any]]) -> list[list[Section]]:
    """The sections each record joins: its run's; a fidelity record without a manifest joins every section of
    its model, dataset and dtype (a section of its own when there is none)."""
    own = [_setup_section(r, manifests) for r in records]
    known = list(dict.fromkeys(s for s in own if s is not None))
    out = []
    for record, section in zip(records, own, strict=True):
        if section is not None:
            out.append([section])
            continue
        model, dataset, dtype = str(record.get("model")), str(record.get("dataset")), record.get("dtype")
        matching = [s for s in known if (s.model, s.dataset) == (model, dataset) and s.dtype in (None, dtype)]
        if not matching:
            matching = [Section(model, dataset, dtype=dtype, prompt_format=record.get("prompt_format"))]
            known += matching
        out.append(matching)
    return out


@dataclass
class Row:
    """One (policy, budget) of a section; ``nan`` where there is nothing to average."""

    section: Section
    policy: str
    budget: int | None
    buffer: int | None
    n: int = 0
    correct: int = 0
    accuracy: float = math.nan
    ci_low: float = math.nan
    ci_high: float = math.nan
    last_number: int = 0  # correct answers taken by the last-number fallback
    cut_off: int = 0  # last-number answers of outputs cut off at the token limit: not counted correct
    mean_output_tokens: float = math.nan
    tokens_per_second: float = math.nan
    collapse_rate: float = math.nan
    early_stop_rate: float = math.nan  # ended by itself without an answer (not a collapse)
    fidelity_n: int = 0
    top1_agreement: float = math.nan
    top1_low: float = math.nan
    top1_high: float = math.nan
    kl_mean: float = math.nan
    kl_low: float = math.nan
    kl_high: float = math.nan
    answer_n: int = 0
    answer_logprob_delta: float = math.nan
    answer_low: float = math.nan
    answer_high: float = math.nan
    answer_logprob_delta_mean: float = math.nan
    problems: int = 0
    errors: int = 0  # failed units; a problem whose generation and fidelity both failed counts once
    error_reasons: tuple[str, ...] = ()  # "N units: reason"
    conflicts: int = 0  # units left out: their results conflict
    samples: int = 0  # fewest samples of any problem
    pass_at: dict[int, float] = field(default_factory=dict)
    paired_problems: int = 0
    delta: float = math.nan  # accuracy minus the full cache's, paired
    delta_low: float = math.nan  # nan with fewer than MIN_PAIRED paired problems
    delta_high: float = math.nan
    delta_varies: bool = False  # whether the per-problem differences are not all the same
    code: dict[str, Any] = field(default_factory=dict)  # code problems: outcomes, per problem, sandbox cost


def _label(record: Record) -> str:
    return str(record.get("policy_label") or record.get("policy") or "?")


def _by_problem(recs: Sequence[dict[str, Any]]) -> dict[Any, dict[Any, bool]]:
    """problem -> sample -> correct."""
    out: dict[Any, dict[Any, bool]] = {}
    for r in recs:
        out.setdefault(r.get("problem_id"), {})[r.get("sample")] = counts_as_correct(r)
    return out


def _pass_at(row: Row, recs: Sequence[dict[str, Any]]) -> None:
    problems = _by_problem(recs)
    if not problems:
        return
    row.samples = min(len(samples) for samples in problems.values())
    ks = sorted({1, *(2**i for i in range(1, 31) if 2**i <= row.samples), row.samples})
    for k in ks:
        row.pass_at[k] = sum(pass_at_k(len(s), sum(s.values()), k) for s in problems.values()) / len(problems)


def _pair_with_full(row: Row, recs: Sequence[dict[str, Any]], full: Sequence[dict[str, Any]]) -> None:
    """Paired accuracy difference to the full cache: same problem and sample (its sample 0 at temperature 0)."""
    reference = _by_problem(full)
    deterministic = row.section.temperature == 0
    differences = []
    for problem, samples in _by_problem(recs).items():
        theirs = reference.get(problem, {})
        pairs = [
            (mine, theirs[s] if s in theirs else theirs.get(0))
            for s, mine in samples.items()
            if s in theirs or (deterministic and 0 in theirs)
        ]
        if pairs:
            differences.append(sum(float(a) - float(b) for a, b in pairs) / len(pairs))
    if differences:
        row.paired_problems = len(differences)
        row.delta = sum(differences) / len(differences)
        row.delta_varies = len(set(differences)) > 1
        if len(differences) >= MIN_PAIRED:
            row.delta_low, row.delta_high = paired_interval(differences)


def _errors(row: Row, group: dict[tuple[str, bool], list[dict]]) -> None:
    """Failed units, a problem's generation and fidelity failures once, with their reasons."""
    failed = group[GenerationRecord.kind, False]
    failed_generation = {r.get("problem_id") for r in failed}
    counted = failed + [r for r in group[FidelityRecord.kind, False] if r.get("problem_id") not in failed_generation]
    row.errors = len(counted)
    reasons = Counter(str(r.get("error")) for r in counted)  # in the order first seen
    row.error_reasons = tuple(f"{n} unit{'' if n == 1 else 's'}: {reason}" for reason, n in reasons.items())


def _fill(row: Row, group: dict[tuple[str, bool], list[dict]]) -> None:
    """The row's numbers from its records, by (the kind of their unit, whether they hold its result)."""
    recs = group[GenerationRecord.kind, True]
    row.n = len(recs)
    row.correct = sum(counts_as_correct(r) for r in recs)
    row.last_number = sum(counts_as_correct(r) and r.get("grading_method") == "last_number" for r in recs)
    row.cut_off = sum(cut_off_guess(r) and r.get("correct") is True for r in recs)
    row.problems = len({r.get("problem_id") for r in recs})
    if row.n:
        row.accuracy = row.correct / row.n
        row.ci_low, row.ci_high = wilson_interval(row.correct, row.n)
    _pass_at(row, recs)
    row.mean_output_tokens = _mean(r.get("output_tokens") for r in recs)
    row.tokens_per_second = _mean(r.get("tokens_per_second") for r in recs)
    row.collapse_rate = _mean(float(bool(r.get("collapsed"))) for r in recs if "collapsed" in r)
    row.early_stop_rate = _mean(float(stopped_early(r.get("collapse"))) for r in recs if "collapse" in r)
    row.code = code_summary(recs)
    fid = group[FidelityRecord.kind, True]
    row.fidelity_n = len(fid)
    row.top1_agreement, row.top1_low, row.top1_high = mean_interval([r.get("top1_agreement") for r in fid])
    row.kl_mean, row.kl_low, row.kl_high = mean_interval([r.get("kl_mean") for r in fid])
    answered = [r for r in fid if r.get("answer_logprob_delta") is not None]
    row.answer_n = len(answered)
    deltas = [r.get("answer_logprob_delta") for r in answered]
    row.answer_logprob_delta, row.answer_low, row.answer_high = mean_interval(deltas)
    row.answer_logprob_delta_mean = _mean(r.get("answer_logprob_delta_mean") for r in answered)
    _errors(row, group)


def summarize(records: Sequence[dict[str, Any]], conflicts: Sequence[Conflict] = ()) -> list[Row]:
    """One :class:`Row` per (section, policy, budget, buffer), full cache first within a section, from
    :func:`load_results` (manifests included) and the conflicting units left out (counted in their rows)."""
    typed = [Record.read(r) for r in records if r.get("kind") in KINDS]
    manifests = {r.get("id"): r.to_json() for r in typed if isinstance(r, ManifestRecord)}
    units = [r for r in typed if not isinstance(r, ManifestRecord)]
    every = units + [Record.read(c.record) for c in conflicts]  # the conflicting units last, only counted
    groups: dict[tuple, tuple[Row, dict[tuple[str, bool], list[dict]]]] = {}  # a row and its records
    policy_order: dict[str, int] = {}
    for index, (record, sections) in enumerate(zip(every, _sections_of(every, manifests), strict=True)):
        policy_order.setdefault(_label(record), len(policy_order))
        for section in sections:
            key = (section, _label(record), record.get("budget"), record.get("buffer"))
            if key not in groups:
                groups[key] = (Row(*key), defaultdict(list))
            row, group = groups[key]
            if index >= len(units):
                row.conflicts += 1
            else:
                group[record.unit, record.result].append(record.to_json())

    rows = []
    full_of: dict[Section, list[dict]] = {}
    for row, group in groups.values():
        _fill(row, group)
        generations = group[GenerationRecord.kind, True]
        if row.budget is None and generations and generations[0].get("policy") == "full":
            full_of[row.section] = generations
        rows.append((row, generations))
    for row, recs in rows:
        if row.budget is not None and row.section in full_of:
            _pair_with_full(row, recs, full_of[row.section])
    out = [row for row, _ in rows]
    section_order = {s: i for i, s in enumerate(dict.fromkeys(r.section for r in out))}
    out.sort(
        key=lambda r: (
            section_order[r.section],
            r.budget is not None,
            policy_order.get(r.policy, 0),
            -1.0 if r.budget is None else float(r.budget),
            r.buffer if r.buffer is not None else -1,
        )
    )
    return out
