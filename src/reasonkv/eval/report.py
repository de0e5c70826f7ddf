"""Tables and plots from eval results files (``reasonkv report``).

Rows are (policy, budget) within a *section*: one model, one dataset and one set of decoding
settings (max new tokens, temperature, top-p, top-k). For each row:

- ``accuracy``: correct / generation records, with a 95% Wilson score interval. With several
  samples per problem the records are counted as independent trials, so the interval is
  somewhat narrower than one over problems would be.
- ``pass@1`` (the share of correct samples of a problem, averaged over problems) and ``pass@k``
  for ``k`` = 2, 4, 8, ... up to the fewest samples any problem of the row has (the unbiased
  estimator ``1 - C(n - c, k) / C(n, k)`` of a problem with ``c`` correct of ``n``, averaged).
- ``Δ vs full``: the accuracy difference to the full cache, *paired*: each answer is compared with
  the full cache's on the same problem and sample seed (at temperature 0 the full cache is
  deterministic, so its one answer pairs with every sample). Differences are averaged per problem,
  then over problems; the 95% interval is a bootstrap over problems (2000 resamples, seed 0).
- ``errors``: units recorded as errors (a cell that could not run shows as errors, not as zeros;
  its accuracy counts only the units that ran).
- ``mean_output_tokens``, ``tokens_per_second`` (mean over records), ``collapse_rate`` (share of
  records flagged ``collapsed``).
- fidelity (from ``"kind": "fidelity"`` records of the same model, dataset, policy and budget):
  mean ``top1_agreement``, mean ``kl_mean`` (KL(full || evicting) per step), and the mean
  answer log-probability deltas (evicting minus full; summed over the answer, and per answer token).

Records are de-duplicated by unit (:func:`reasonkv.eval.records.unit_key`; a result replaces an error
record, otherwise the last wins), so concatenated or overlapping files, and a run's shard files
(read with it: ``results.shard-I-of-N.jsonl`` next to ``results.jsonl``), can be reported together.
The report starts with the run manifests of its files. Needs matplotlib only for the plots.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reasonkv.eval.manifest import describe
from reasonkv.eval.records import KEY_FIELDS, record_problem, unit_key
from reasonkv.eval.shards import shard_files
from reasonkv.runs.outputs import claim_folder
from reasonkv.runs.store import numbered_records

__all__ = [
    "Row",
    "Section",
    "load_results",
    "markdown",
    "pass_at_k",
    "plot",
    "summarize",
    "wilson_interval",
    "write_report",
]

Z95 = 1.959963984540054


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


@dataclass(frozen=True)
class Section:
    model: str
    dataset: str
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @property
    def title(self) -> str:
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
        return f"{self.dataset} · {self.model}" + (f" ({'; '.join(settings)})" if settings else "")


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
    mean_output_tokens: float = math.nan
    tokens_per_second: float = math.nan
    collapse_rate: float = math.nan
    fidelity_n: int = 0
    top1_agreement: float = math.nan
    kl_mean: float = math.nan
    answer_n: int = 0
    answer_logprob_delta: float = math.nan
    answer_logprob_delta_mean: float = math.nan
    problems: int = 0
    errors: int = 0  # units recorded as errors (generation and fidelity)
    error_reasons: tuple[str, ...] = ()
    samples: int = 0  # fewest samples of any problem
    pass_at: dict[int, float] = field(default_factory=dict)
    paired_problems: int = 0
    delta: float = math.nan  # accuracy minus the full cache's, paired
    delta_low: float = math.nan
    delta_high: float = math.nan


def _run_files(path: str | os.PathLike[str]) -> list[Path]:
    path = Path(path)
    files = ([path] if path.is_file() else []) + [p for p, _ in shard_files(path)]
    if not files:
        raise FileNotFoundError(f"no such results file: {path}")
    return files


def load_results(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *, drop: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Records of results files and their shard files, one per unit (see the module docstring).

    Manifests and records of other kinds follow the unit records; ``drop`` names fields left out of
    every record (a report needs neither ``output_ids`` nor ``output_text``). A record ``eval`` would
    refuse (a hand edit: :func:`reasonkv.eval.records.record_problem`) raises ``ValueError`` naming the
    file, the line and the field.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    by_unit: dict[tuple, dict[str, Any]] = {}
    others: list[dict[str, Any]] = []
    for path in paths:
        for file in _run_files(path):
            for number, record in numbered_records(file):
                problem = record_problem(record)
                if problem is not None:
                    raise ValueError(f"{file}, line {number}: {problem}; restore that line as it was written")
                for name in drop:
                    record.pop(name, None)
                if record.get("kind") not in (*KEY_FIELDS, "error"):
                    others.append(record)
                    continue
                key = unit_key(record)
                if record.get("kind") != "error" or by_unit.get(key, {}).get("kind") in (None, "error"):
                    by_unit[key] = record
    return list(by_unit.values()) + others


def _mean(values: Iterable[Any]) -> float:
    finite = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _label(record: dict[str, Any]) -> str:
    return str(record.get("policy_label") or record.get("policy") or "?")


def _budget_sort(budget: int | None) -> float:
    return -1.0 if budget is None else float(budget)


def _section(r: dict[str, Any]) -> Section:
    return Section(
        str(r.get("model")),
        str(r.get("dataset")),
        r.get("max_new_tokens"),
        r.get("temperature"),
        r.get("top_p"),
        r.get("top_k"),
    )


def _by_problem(recs: Sequence[dict[str, Any]]) -> dict[Any, dict[Any, bool]]:
    """problem -> sample -> correct."""
    out: dict[Any, dict[Any, bool]] = {}
    for r in recs:
        out.setdefault(r.get("problem_id"), {})[r.get("sample")] = bool(r.get("correct"))
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
        row.delta_low, row.delta_high = paired_interval(differences)


def summarize(records: Sequence[dict[str, Any]]) -> list[Row]:
    """One :class:`Row` per (section, policy, budget, buffer), full cache first within a section."""
    generations = [r for r in records if r.get("kind") == "generation"]
    fidelities = [r for r in records if r.get("kind") == "fidelity"]
    failed = [r for r in records if r.get("kind") == "error"]
    groups: dict[tuple, list[dict]] = {}
    errors: dict[tuple, list[dict]] = {}
    policy_order: dict[str, int] = {}
    for r in generations:
        policy_order.setdefault(_label(r), len(policy_order))
        groups.setdefault((_section(r), _label(r), r.get("budget"), r.get("buffer")), []).append(r)
    for r in failed:
        if r.get("unit") == "generation":
            policy_order.setdefault(_label(r), len(policy_order))
            key = (_section(r), _label(r), r.get("budget"), r.get("buffer"))
            groups.setdefault(key, [])
            errors.setdefault(key, []).append(r)
    fid_groups: dict[tuple, list[dict]] = {}
    fid_errors: dict[tuple, list[dict]] = {}
    for r in fidelities + [r for r in failed if r.get("unit") == "fidelity"]:
        policy_order.setdefault(_label(r), len(policy_order))
        key = (str(r.get("model")), str(r.get("dataset")), _label(r), r.get("budget"), r.get("buffer"))
        (fid_errors if r.get("kind") == "error" else fid_groups).setdefault(key, []).append(r)
    sections_of: dict[tuple[str, str], list[Section]] = {}
    for section, *_ in groups:
        found = sections_of.setdefault((section.model, section.dataset), [])
        if section not in found:
            found.append(section)
    # Fidelity does not depend on the sampling settings: it joins every section of its model and dataset.
    for model, dataset, label, budget, buffer in [*fid_groups, *fid_errors]:
        sections = sections_of.setdefault((model, dataset), [])
        if not sections:
            sections.append(Section(model, dataset))
        for section in sections:
            groups.setdefault((section, label, budget, buffer), [])

    rows = []
    full_of: dict[Section, list[dict]] = {}
    for (section, label, budget, buffer), recs in groups.items():
        row = Row(section=section, policy=label, budget=budget, buffer=buffer)
        row.n = len(recs)
        row.correct = sum(bool(r.get("correct")) for r in recs)
        row.problems = len({r.get("problem_id") for r in recs})
        if row.n:
            row.accuracy = row.correct / row.n
            row.ci_low, row.ci_high = wilson_interval(row.correct, row.n)
        _pass_at(row, recs)
        if budget is None and recs and recs[0].get("policy") == "full":
            full_of[section] = recs
        row.mean_output_tokens = _mean(r.get("output_tokens") for r in recs)
        row.tokens_per_second = _mean(r.get("tokens_per_second") for r in recs)
        row.collapse_rate = _mean(float(bool(r.get("collapsed"))) for r in recs if "collapsed" in r)
        fid_key = (section.model, section.dataset, label, budget, buffer)
        fid = fid_groups.get(fid_key, [])
        row.fidelity_n = len(fid)
        row.top1_agreement = _mean(r.get("top1_agreement") for r in fid)
        row.kl_mean = _mean(r.get("kl_mean") for r in fid)
        answered = [r for r in fid if r.get("answer_logprob_delta") is not None]
        row.answer_n = len(answered)
        row.answer_logprob_delta = _mean(r.get("answer_logprob_delta") for r in answered)
        row.answer_logprob_delta_mean = _mean(r.get("answer_logprob_delta_mean") for r in answered)
        failures = errors.get((section, label, budget, buffer), []) + fid_errors.get(fid_key, [])
        row.errors = len(failures)
        row.error_reasons = tuple(dict.fromkeys(str(r.get("error")) for r in failures))
        rows.append((row, recs))
    for row, recs in rows:
        if row.budget is not None and row.section in full_of:
            _pair_with_full(row, recs, full_of[row.section])
    rows = [row for row, _ in rows]
    section_order = {s: i for i, s in enumerate(dict.fromkeys(r.section for r in rows))}
    rows.sort(
        key=lambda r: (
            section_order[r.section],
            r.budget is not None,
            policy_order.get(r.policy, 0),
            _budget_sort(r.budget),
            r.buffer if r.buffer is not None else -1,
        )
    )
    return rows


# ---------------------------------------------------------------------------------- markdown


def _num(value: float, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _budget_text(row: Row, uniform_buffer: bool) -> str:
    if row.budget is None:
        return "—"
    return str(row.budget) if uniform_buffer else f"{row.budget} (B={row.buffer})"


HEADER = (
    "| policy | budget | n | errors | accuracy [95% CI] | pass@1 | pass@k | Δ vs full [95% CI] | mean output tokens "
    "| tokens/s | collapse rate | top-1 agreement | KL(full‖evicting) | Δ answer log-prob (sum) "
    "| Δ answer log-prob (per token) |"
)


def _cells(r: Row, uniform: bool) -> list[str]:
    no_accuracy = "error" if r.errors else "—"
    accuracy = f"{r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]" if r.n else no_accuracy
    pass_k = f"{r.pass_at[r.samples]:.3f} (k={r.samples})" if r.samples > 1 else "—"
    delta = "—" if math.isnan(r.delta) else f"{r.delta:+.3f} [{r.delta_low:+.3f}, {r.delta_high:+.3f}]"
    return [
        r.policy,
        _budget_text(r, uniform),
        str(r.n),
        str(r.errors),
        accuracy,
        _num(r.pass_at.get(1, math.nan), ".3f"),
        pass_k,
        delta,
        _num(r.mean_output_tokens, ".1f"),
        _num(r.tokens_per_second, ".1f"),
        _num(r.collapse_rate, ".3f"),
        _num(r.top1_agreement, ".3f"),
        _num(r.kl_mean, ".4g"),
        _num(r.answer_logprob_delta, "+.3f"),
        _num(r.answer_logprob_delta_mean, "+.3f"),
    ]


def markdown(rows: Sequence[Row], *, source: str | None = None, manifests: Sequence[dict[str, Any]] = ()) -> str:
    """The report as markdown: the runs' manifests, then one table per section."""
    lines = ["# Evaluation report", ""]
    if source:
        lines += [f"Source: {source}", ""]
    unique = list({m.get("id"): m for m in manifests}.values())
    if unique:
        lines += ["## Runs", "", *[line for m in unique for line in describe(m)], ""]
    lines += [
        "Accuracy: share of graded records correct, 95% Wilson interval. pass@1: share of correct samples per "
        "problem, averaged; pass@k: unbiased estimate with k samples. Δ vs full: accuracy minus the full cache's "
        "on the same problems and sample seeds (paired), 95% bootstrap interval over problems. Errors: units that "
        "could not run (their reasons below the table). Collapse: empty output, a repetition loop, or running out "
        "of tokens without an answer. Fidelity (evicting vs full cache, teacher-forced): top-1 agreement and mean "
        "KL along the full cache's greedy trace; Δ answer log-prob: log-probability of the reference answer with "
        "the evicting cache minus with the full cache (0 is perfect, negative is worse).",
        "",
    ]
    for section in dict.fromkeys(r.section for r in rows):
        part = [r for r in rows if r.section == section]
        buffers = {r.buffer for r in part if r.budget is not None}
        uniform = len(buffers) <= 1
        title = section.title
        if uniform and buffers:
            title += f", buffer B={next(iter(buffers))}"
        lines += [f"## {title}", "", HEADER, "|" + "---|" * 15]
        lines += ["| " + " | ".join(_cells(r, uniform)) + " |" for r in part]
        failures = [r for r in part if r.errors]
        if failures:
            lines += ["", "Errors:"]
            for r in failures:
                name = r.policy if r.budget is None else f"{r.policy}@{r.budget}"
                lines += [f"- {name}: {r.errors} units: {reason}" for reason in r.error_reasons]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- plots


def _slug(section: Section) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{Path(section.dataset).stem}-{Path(section.model).name}").strip("_")


def _section_slugs(sections: Sequence[Section]) -> dict[Section, str]:
    slugs: dict[Section, str] = {}
    used: dict[str, int] = {}
    for section in sections:
        base = _slug(section)
        used[base] = used.get(base, 0) + 1
        slugs[section] = base if used[base] == 1 else f"{base}-{used[base]}"
    return slugs


def _series(rows: Sequence[Row]) -> dict[str, list[Row]]:
    evicting = [r for r in rows if r.budget is not None]
    several_buffers = len({r.buffer for r in evicting}) > 1
    out: dict[str, list[Row]] = {}
    for r in evicting:
        out.setdefault(f"{r.policy} B={r.buffer}" if several_buffers else r.policy, []).append(r)
    return out


def _budget_axis(ax, budgets: list[int]) -> None:
    if budgets and max(budgets) >= 4 * min(budgets):
        ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    ax.set_xlabel("budget K (tokens kept per head)")
    ax.grid(alpha=0.3)


def _metric_panel(ax, rows: Sequence[Row], attr: str, ylabel: str, *, band: tuple[str, str] | None = None) -> bool:
    """Plot ``attr`` vs budget per policy (full as a horizontal line); False if nothing to draw."""
    drawn = False
    budgets = sorted({r.budget for r in rows if r.budget is not None})
    all_series = _series(rows)
    for i, (policy, series) in enumerate(all_series.items()):
        series = sorted((r for r in series if not math.isnan(getattr(r, attr))), key=lambda r: r.budget)
        if not series:
            continue
        ys = [getattr(r, attr) for r in series]
        if band:  # spread the policies a little so their error bars do not hide each other
            xs = [r.budget * (1 + 0.015 * (i - (len(all_series) - 1) / 2)) for r in series]
            lo = [y - getattr(r, band[0]) for r, y in zip(series, ys, strict=True)]
            hi = [getattr(r, band[1]) - y for r, y in zip(series, ys, strict=True)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=policy)
        else:
            ax.plot([r.budget for r in series], ys, marker="o", label=policy)
        drawn = True
    for r in rows:
        if r.budget is None and not math.isnan(getattr(r, attr)):
            y = getattr(r, attr)
            ax.axhline(y, color="black", linestyle="--", linewidth=1, label=f"{r.policy} (no eviction)")
            if band:
                ax.axhspan(getattr(r, band[0]), getattr(r, band[1]), color="black", alpha=0.06)
            drawn = True
    _budget_axis(ax, budgets)
    ax.set_ylabel(ylabel)
    return drawn


def plot(rows: Sequence[Row], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the PNG plots of every section to ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    sections = list(dict.fromkeys(r.section for r in rows))
    slugs = _section_slugs(sections)

    def save(fig, name: str, section: Section) -> None:
        fig.suptitle(section.title, fontsize=9)
        fig.tight_layout()
        path = out_dir / f"{slugs[section]}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for section in sections:
        part = [r for r in rows if r.section == section]
        panels = [
            ("accuracy", "accuracy", "accuracy (95% CI)", ("ci_low", "ci_high")),
            ("collapse", "collapse_rate", "collapse rate", None),
            ("throughput", "tokens_per_second", "decode tokens/s", None),
        ]
        for name, attr, ylabel, band in panels:
            fig, ax = plt.subplots(figsize=(6, 4))
            if _metric_panel(ax, part, attr, ylabel, band=band):
                if attr in ("accuracy", "collapse_rate"):
                    ax.set_ylim(-0.02, 1.02)
                ax.legend(fontsize=7)
                save(fig, name, section)
            else:
                plt.close(fig)
        if any(r.fidelity_n for r in part):
            fig, axes = plt.subplots(1, 3, figsize=(14, 4))
            _metric_panel(axes[0], part, "top1_agreement", "top-1 agreement with the full cache")
            _metric_panel(axes[1], part, "kl_mean", "mean KL(full ‖ evicting)")
            if all(r.kl_mean > 0 for r in part if not math.isnan(r.kl_mean)) and any(
                not math.isnan(r.kl_mean) for r in part
            ):
                axes[1].set_yscale("log")
            _metric_panel(axes[2], part, "answer_logprob_delta", "Δ reference-answer log-prob (sum)")
            axes[2].axhline(0.0, color="grey", linewidth=0.8)
            axes[0].legend(fontsize=7)
            save(fig, "fidelity", section)
    return written


# ---------------------------------------------------------------------------------- all of it


def _finite(value: Any) -> Any:
    """NaN (nothing to average) as null, so the summary is strict JSON."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _plot_names(rows: Sequence[Row]) -> list[str]:
    """Every PNG :func:`plot` may write for ``rows``."""
    slugs = _section_slugs(list(dict.fromkeys(r.section for r in rows)))
    return [
        f"{slug}-{name}.png" for slug in slugs.values() for name in ("accuracy", "collapse", "throughput", "fidelity")
    ]


def _is_old_report(folder: Path) -> bool:
    """A report folder from before output markers: its report.md or summary.json is a report's."""
    try:
        if (folder / "report.md").read_text(encoding="utf-8").startswith("# Evaluation report"):
            return True
    except (OSError, UnicodeDecodeError):
        pass
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(summary, list) and all(isinstance(r, dict) and "section" in r and "policy" in r for r in summary)


def write_report(
    results: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]
) -> dict[str, Any]:
    """Write ``report.md``, ``summary.json`` and the PNG plots of ``results`` (and their shards) to ``out_dir``.

    ``out_dir`` must be a report folder of this tool, or new, or free of the files a report writes (see
    :mod:`reasonkv.runs.outputs`); it is locked while the report is written.
    Returns ``{"markdown": path, "summary": path, "plots": [paths], "rows": [Row], "manifests": [dict]}``.
    """
    paths = [results] if isinstance(results, (str, os.PathLike)) else list(results)
    records = load_results(paths, drop=("output_ids", "output_text"))
    if not any(r.get("kind") in (*KEY_FIELDS, "error") for r in records):
        raise ValueError(f"no generation or fidelity records in {', '.join(map(str, paths))}")
    manifests = [r for r in records if r.get("kind") == "manifest"]
    rows = summarize(records)
    out_dir = Path(out_dir)
    names = ["report.md", "summary.json", *_plot_names(rows)]
    inputs = [file for path in paths for file in _run_files(path)]
    with claim_folder(out_dir, "report", names, recognise=_is_old_report, inputs=inputs):
        md_path = out_dir / "report.md"
        md_path.write_text(markdown(rows, source=", ".join(map(str, paths)), manifests=manifests), encoding="utf-8")
        summary_path = out_dir / "summary.json"
        summary = [_finite({**asdict(r), "section": asdict(r.section)}) for r in rows]
        summary_path.write_text(json.dumps(summary, indent=1, default=str, allow_nan=False), encoding="utf-8")
        plots = plot(rows, out_dir)
    return {"markdown": md_path, "summary": summary_path, "plots": plots, "rows": rows, "manifests": manifests}
