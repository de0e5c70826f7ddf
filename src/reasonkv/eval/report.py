"""``reasonkv report``: ``report.md``, ``summary.json`` and PNG plots from eval results files (the numbers
are :mod:`reasonkv.eval.report_rows`'s, the plots :mod:`reasonkv.eval.report_plots`'s).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from reasonkv.eval.code_report import outcome_table
from reasonkv.eval.manifest import describe
from reasonkv.eval.report_plots import plot, plot_names
from reasonkv.eval.report_rows import (
    MIN_PAIRED,
    Conflict,
    Row,
    Section,
    load_results,
    paired_interval,
    pass_at_k,
    read_report_input,
    run_files,
    section_names,
    summarize,
    wilson_interval,
)
from reasonkv.runs.outputs import claim_folder
from reasonkv.runs.paths import portable_path
from reasonkv.runs.store import json_safe

__all__ = [
    "Row",
    "Section",
    "load_results",
    "markdown",
    "paired_interval",
    "pass_at_k",
    "plot",
    "summarize",
    "wilson_interval",
    "write_report",
]

#: What the bundled models are, for every report that shows their results.
BUNDLED_NOTE = {
    "smollm2-135m": "SmolLM2-135M-Instruct from a Q4_1 GGUF file, dequantized on load",
    "gemma3-270m": "Gemma 3 270M (base) from a Q4_K_M GGUF file, dequantized on load",
}

LEGEND = (
    "Accuracy: share of graded answers correct, 95% Wilson interval. An answer is looked for as a boxed answer, "
    "then 'the answer is X' or 'Answer: X'; for a reference that is a plain number (GSM8K), the last number of an "
    "output that ended by itself counts too (the last-number fallback, counted apart below each table), but never "
    "that of an output cut off at the token limit. pass@1: share of correct samples per problem, averaged; "
    "pass@k: unbiased estimate with k samples. Δ vs full: accuracy minus the full cache's on the same problems "
    f"and sample seeds (paired), 95% bootstrap interval over problems, given from {MIN_PAIRED} problems on. "
    "Errors: units that could not run (a problem whose generation and fidelity both failed counts once; reasons "
    "below the table). Collapse: empty output, a repetition loop, or running out of tokens without an answer. "
    "Early stop: the output ended by itself before the token limit without an answer (not a collapse, counted "
    "apart). Fidelity (evicting vs full cache, teacher-forced): top-1 agreement and mean KL along the full cache's "
    "greedy trace; Δ answer log-prob: log-probability of the reference answer with the evicting cache minus with the "
    "full cache (0 is perfect, negative is worse); the plots show 95% intervals of these means over problems."
)

HEADER = (
    "| policy | budget | n | errors | accuracy [95% CI] | pass@1 | pass@k | Δ vs full [95% CI] | mean output tokens "
    "| tokens/s | collapse rate | early stop rate | top-1 agreement | KL(full‖evicting) | Δ answer log-prob (sum) "
    "| Δ answer log-prob (per token) |"
)


def _num(value: float, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _delta(r: Row) -> str:
    if math.isnan(r.delta):
        return "—"
    if not r.delta_varies:
        same = "no problem differs" if r.delta == 0 else "every problem differs by this"
        return f"{r.delta:+.3f} ({same}, {r.paired_problems} problem{'s' if r.paired_problems > 1 else ''})"
    if r.paired_problems < MIN_PAIRED:
        return f"{r.delta:+.3f} ({r.paired_problems} problems: too few for an interval)"
    return f"{r.delta:+.3f} [{r.delta_low:+.3f}, {r.delta_high:+.3f}]"


def _cells(r: Row, uniform: bool) -> list[str]:
    no_accuracy = "error" if r.errors else "—"
    accuracy = f"{r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]" if r.n else no_accuracy
    pass_k = f"{r.pass_at[r.samples]:.3f} (k={r.samples})" if r.samples > 1 else "—"
    return [
        r.policy,
        "—" if r.budget is None else str(r.budget) if uniform else f"{r.budget} (B={r.buffer})",
        str(r.n),
        str(r.errors) + (f" (+{r.conflicts} conflicting)" if r.conflicts else ""),
        accuracy,
        _num(r.pass_at.get(1, math.nan), ".3f"),
        pass_k,
        _delta(r),
        _num(r.mean_output_tokens, ".1f"),
        _num(r.tokens_per_second, ".1f"),
        _num(r.collapse_rate, ".3f"),
        _num(r.early_stop_rate, ".3f"),
        _num(r.top1_agreement, ".3f"),
        _num(r.kl_mean, ".4g"),
        _num(r.answer_logprob_delta, "+.3f"),
        _num(r.answer_logprob_delta_mean, "+.3f"),
    ]


def _name(r: Row) -> str:
    return r.policy if r.budget is None else f"{r.policy}@{r.budget}"


def _setups_note(sections: Sequence[Section]) -> list[str]:
    """A warning when the results hold more than one setup."""
    setups = list(dict.fromkeys((s.model, *s.settings().values()) for s in sections))
    if len(setups) <= 1:
        return []
    names = ["model", *sections[0].settings()]
    differing = [
        f"{name.replace('_', ' ')} ({', '.join(dict.fromkeys(str(s[i]) for s in setups))})"
        for i, name in enumerate(names)
        if len({s[i] for s in setups}) > 1
    ]
    return [
        f"**These results come from {len(setups)} setups** (they differ in {'; '.join(differing)}). Each section "
        "below holds the records of one setup only, each record in the section of the run that wrote it; compare "
        "numbers within a section.",
        "",
    ]


def _conflicts_note(conflicts: Sequence[Conflict]) -> list[str]:
    if not conflicts:
        return []
    lines = [
        f"**{len(conflicts)} unit{'s have' if len(conflicts) > 1 else ' has'} conflicting records**: two results of "
        "the same unit that differ. They are left out of every number below (counted as *conflicting* beside the "
        "errors); remove the wrong records, or report the files apart.",
        "",
    ]
    for c in conflicts:
        r = c.record
        budget = "" if r.get("budget") is None else f"@{r['budget']}"
        lines.append(
            f"- {r.get('dataset')} {r.get('problem_id')} {r.get('policy_label') or r.get('policy')}{budget} "
            f"({r['kind']}): differ in {', '.join(c.fields)}; {'; '.join(c.places)}"
        )
    return lines + [""]


def _models_note(rows: Sequence[Row]) -> list[str]:
    models = dict.fromkeys(r.section.model for r in rows)
    notes = [f"`{m}` is {BUNDLED_NOTE[m]}" for m in models if m in BUNDLED_NOTE]
    return [f"Models: {'; '.join(notes)}, not the original bf16 weights.", ""] if notes else []


def _section_notes(part: Sequence[Row]) -> list[str]:
    lines: list[str] = []
    failures = [r for r in part if r.errors]
    if failures:
        lines += ["", "Errors:"]
        lines += [f"- {_name(r)}: {reason}" for r in failures for reason in r.error_reasons]
    fallback = [r for r in part if r.last_number or r.cut_off]
    if fallback:
        lines += ["", "Answers from the last-number fallback (no boxed or 'answer is' answer):"]
        for r in fallback:
            said = [f"{r.last_number} of its {r.correct} correct answers"] if r.last_number else []
            if r.cut_off:
                outputs = "outputs" if r.cut_off > 1 else "an output"
                said.append(
                    f"{r.cut_off} from {outputs} cut off at the token limit, graded correct when written, "
                    "not counted correct"
                )
            lines.append(f"- {_name(r)}: {'; '.join(said)}")
    return lines


def markdown(
    rows: Sequence[Row],
    *,
    source: str | None = None,
    manifests: Sequence[dict[str, Any]] = (),
    conflicts: Sequence[Conflict] = (),
    plots: dict[Section, dict[str, str]] | None = None,
) -> str:
    """The report as markdown: what to know first, the runs' manifests, then one table per section, with the
    plot files ``plots`` gives it (:func:`~reasonkv.eval.report_plots.plot_names`)."""
    sections = list(dict.fromkeys(r.section for r in rows))
    lines = ["# Evaluation report", ""]
    if source:
        lines += [f"Source: {source}", ""]
    lines += _setups_note(sections) + _conflicts_note(conflicts) + _models_note(rows)
    unique = list({m.get("id"): m for m in manifests}.values())
    if unique:
        lines += ["## Runs", "", *[line for m in unique for line in describe(m)], ""]
    lines += [LEGEND, ""]
    titles = section_names(sections)
    for section in sections:
        part = [r for r in rows if r.section == section]
        buffers = {r.buffer for r in part if r.budget is not None}
        uniform = len(buffers) <= 1
        title = titles[section][0]
        if uniform and buffers:
            title += f", buffer B={next(iter(buffers))}"
        lines += [f"## {title}", "", HEADER, "|" + "---|" * 16]
        lines += ["| " + " | ".join(_cells(r, uniform)) + " |" for r in part]
        lines += outcome_table(part)
        lines += _section_notes(part)
        files = (plots or {}).get(section, {})
        if files:
            lines += ["", *[f"![{name}]({file})" for name, file in files.items()]]
        lines.append("")
    return "\n".join(lines)


def _is_old_report(folder: Path) -> bool:
    """A report folder from before output markers: its report.md or summary.json is a report's."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if (folder / "report.md").read_text(encoding="utf-8").startswith("# Evaluation report"):
            return True
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(summary, list) and all(isinstance(r, dict) and "section" in r and "policy" in r for r in summary)


def write_report(
    results: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]
) -> dict[str, Any]:
    """Write ``report.md``, ``summary.json`` and the PNG plots of ``results`` (and their shards) to ``out_dir``
    (claimed as :mod:`reasonkv.runs.outputs` says; stale plots removed); returns the paths written
    (``markdown``, ``summary``, ``plots``) and the ``rows``, ``manifests`` and ``conflicts``."""
    paths = [results] if isinstance(results, (str, os.PathLike)) else list(results)
    read = read_report_input(paths, drop=("output_ids", "output_text"))
    if not read.records and not read.conflicts:
        raise ValueError(f"no generation or fidelity records in {', '.join(map(str, paths))}")
    rows = summarize(read.records + read.manifests, read.conflicts)
    out_dir = Path(out_dir)
    possible = [file for files in plot_names(rows, drawn=False).values() for file in files.values()]
    names = ["report.md", "summary.json", *possible]
    inputs = [file for path in paths for file in run_files(path)]
    with claim_folder(out_dir, "report", names, recognise=_is_old_report, inputs=inputs):
        plots = plot(rows, out_dir)
        for stale in set(possible) - {p.name for p in plots}:
            (out_dir / stale).unlink(missing_ok=True)
        md_path = out_dir / "report.md"
        text = markdown(
            rows,
            source=", ".join(portable_path(p, out_dir) for p in paths),  # as typed, or not the machine's
            manifests=read.manifests,
            conflicts=read.conflicts,
            plots=plot_names(rows),
        )
        md_path.write_text(text, encoding="utf-8")
        summary_path = out_dir / "summary.json"
        summary = [json_safe({**asdict(r), "section": asdict(r.section)}) for r in rows]  # NaN as null
        summary_path.write_text(json.dumps(summary, indent=1, default=str, allow_nan=False), encoding="utf-8")
    return {
        "markdown": md_path,
        "summary": summary_path,
        "plots": plots,
        "rows": rows,
        "manifests": read.manifests,
        "conflicts": read.conflicts,
    }
