"""The markdown summary of a calibration run: the answer first, then the numbers behind it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from reasonkv.calibrate.auc import AucRow
from reasonkv.calibrate.bands import Band
from reasonkv.calibrate.pipeline import Analysis
from reasonkv.calibrate.profile import Profile

__all__ = ["render_summary"]

_TARGET_WORDS = {
    "later": "mean log-likelihood drop of the later trace tokens",
    "later_sum": "summed log-likelihood drop of the later trace tokens",
    "answer": "log-likelihood drop of the final answer",
}
_SIGNAL_WORDS = {"z": "causal z-score of g (EPIKV's default signal)", "g": "raw g"}
_CONTROL_WORDS = {
    "position": " with the chunk's position in the trace partialled out (does the layer know more than where the "
    "chunk is?)",
    "none": " (no control for position)",
}


def _fmt(value: float, low: float | None = None, high: float | None = None) -> str:
    if value is None or np.isnan(value):
        return "n/a"
    if low is None:
        return f"{value:+.3f}"
    return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"


def _span(layers: Sequence[int]) -> str:
    return f"{min(layers)}..{max(layers)}"


def _band_line(
    name: str, meaning: str, band: Band | None, default: Sequence[int], main: Profile, written: Sequence[int]
) -> str:
    if band is None:
        mean, low, high = main.band(list(default))
        kept = (
            "keeps the scaled default"
            if list(written) == list(default)
            else "takes the best-signed layers outside the other band,"
        )
        return (
            f"- **Band {name}** ({meaning}): **not found** by the rule (the scaled default {_span(default)} has mean "
            f"rho {_fmt(mean, low, high)} here). The calibration file {kept} layers {list(written)} for this side."
        )
    overlap = sorted(set(band.layers) & set(default))
    relation = f"overlaps the scaled default {_span(default)} at {len(overlap)} layer(s)"
    if not overlap:
        relation = f"does not overlap the scaled default {_span(default)}"
    return (
        f"- **Band {name}** ({meaning}): layers **{band.first}..{band.last}**, representative layer "
        f"**{band.representative}**; mean rho {_fmt(band.rho, band.low, band.high)}; {relation}."
    )


def _verdict(analysis: Analysis) -> str:
    a, b = analysis.band_a, analysis.band_b
    if a and b:
        order = "below" if a.last < b.first else "above" if a.first > b.last else "interleaved with"
        return (
            "**Yes.** Both bands exist in this model: a band whose change marks important chunks and one whose "
            f"change marks filler, with band A {order} band B (the paper found A below B)."
        )
    if a or b:
        found = "A (important)" if a else "B (filler)"
        return (
            f"**Partly.** Only band {found} passes the rule with {analysis.traces} traces; the other side shows no "
            "run of layers whose interval excludes zero (it may be absent, or need more traces)."
        )
    return (
        f"**Not detected.** No run of layers has an interval that excludes zero with {analysis.traces} traces: the "
        "two-band structure is absent at this resolution, or needs more traces."
    )


def _layer_table(analysis: Analysis, targets: Sequence[str]) -> list[str]:
    columns = [(signal, target) for target in targets for signal in ("z", "g")]
    head = "| layer | band | " + " | ".join(f"rho {s} / {t}" for s, t in columns) + " |"
    lines = [head, "|" + "---|" * (2 + len(columns))]
    a = set(analysis.band_a.layers) if analysis.band_a else set()
    b = set(analysis.band_b.layers) if analysis.band_b else set()
    profiles = [analysis.profiles[key] for key in columns]
    for layer in range(analysis.main.num_layers):
        mark = "A" if layer in a else "B" if layer in b else ""
        cells = [_fmt(p.rho[layer], p.low[layer], p.high[layer]) for p in profiles]
        lines.append(f"| {layer} | {mark} | " + " | ".join(cells) + " |")
    return lines


def _auc_table(tables: Mapping[str, list[AucRow]], main: str) -> list[str]:
    targets = [main, *[t for t in tables if t != main]]
    lines = [
        "| score | " + " | ".join(f"AUC {t} [95% CI] | rho {t}" for t in targets) + " |",
        "|---|" + "---|---|" * len(targets),
    ]
    by_target = {t: {row.name: row for row in tables[t]} for t in targets}
    for row in tables[main]:
        cells = []
        for t in targets:
            r = by_target[t][row.name]
            cells += [_fmt(r.auc, r.low, r.high).replace("+", ""), _fmt(r.spearman)]
        lines.append(f"| `{row.name}` | " + " | ".join(cells) + " |")
    return lines


def render_summary(
    analysis: Analysis,
    *,
    calibration: Any,
    default: Any,
    run: Mapping[str, Any],
    plot_file: str | None = "correlation.png",
) -> str:
    """The summary page. ``run`` holds ``model``, ``dataset``, ``source``, ``chunk_size``,
    ``horizon``, ``replicates``, ``fraction``, ``command`` (shown as given) and may hold ``weights``: what the
    model's weights are when they are not the original ones (a bundled model's quantized file)."""
    main = analysis.main
    weights = [f"Weights: {run['weights']}; every figure below is that model's.", ""] if run.get("weights") else []
    lines = [
        f"# Layer anatomy of `{run['model']}` ({main.num_layers} layers)",
        "",
        *weights,
        f"{analysis.traces} traces ({run['source']} traces of `{run['dataset']}`; {main.n_traces} have enough "
        f"labelled chunks for a correlation), {analysis.chunks} chunks of "
        f"{run['chunk_size']} tokens. Importance label of a chunk: the {_TARGET_WORDS[main.target]} when the "
        "chunk is hidden from every later query through the attention mask. Signal: the "
        f"{_SIGNAL_WORDS[main.signal]}, averaged over the chunk. rho: Spearman correlation of a layer's chunk "
        f"signal with the labels within a trace{_CONTROL_WORDS[main.control]}, averaged over traces; brackets: "
        f"{main.level:.0%} bootstrap interval over traces ({run['replicates']} resamples).",
        "",
        "How much the labels follow position alone (mean per-trace Spearman of label and chunk index): "
        + ", ".join(f"{t} {_fmt(v)}" for t, v in analysis.label_position.items())
        + ".",
        "",
        "## Does the two-band structure exist in this model?",
        "",
        _verdict(analysis),
        "",
        _band_line("A", "change marks important chunks", analysis.band_a, default.band_a, main, calibration.band_a),
        _band_line("B", "change marks filler", analysis.band_b, default.band_b, main, calibration.band_b),
        f"- Depth-scaled default from the paper's 32-layer anatomy: A {_span(default.band_a)} (a = {default.a}), "
        f"B {_span(default.band_b)} (b = {default.b}).",
        f"- Calibration written: a = {calibration.a}, b = {calibration.b}, band A {list(calibration.band_a)}, "
        f"band B {list(calibration.band_b)} (`calibration.json`; load it with "
        '`reasonkv.get_policy("epikv", calibration="calibration.json")`).',
        "",
        "Band rule: layers whose interval lies entirely above (A) or below (B) zero; runs of at least "
        f"{run.get('min_width', 3)} consecutive such layers; a run longer than {run.get('max_width', 8)} is cut to "
        "its strongest window; the strongest run wins; its representative is its strongest layer.",
        "",
    ]
    if plot_file:
        lines += [f"![per-layer correlation]({plot_file})", ""]
    lines += ["## Per-layer correlation", "", *_layer_table(analysis, [main.target, "answer"]), ""]
    if analysis.auc:
        lines += [
            f"## Which score finds the important chunks? (AUC for the top {run['fraction']:.0%} chunks of each trace)",
            "",
            "Mean per-trace AUC (0.5 = chance) and mean per-trace Spearman rho. EPIKV-family scores are read at the "
            "scaled default layers (`@default`) and at the calibrated ones (`@cal`); note that `@cal` was chosen on "
            "these same traces, so its numbers are optimistic. Attention scores are computed offline from the full "
            "attention of one teacher-forced pass, averaged over the full-attention layers and the heads, as seen at "
            "the end of the trace.",
            "",
            *_auc_table(analysis.auc, main.target),
            "",
        ]
    lines += [
        "## Reproduce",
        "",
        f"Mean time per trace (labels + signals): {analysis.seconds_per_trace:.1f} s wall, "
        f"{analysis.cpu_seconds_per_trace:.1f} s CPU (all threads).",
        "",
        "```",
        str(run.get("command", "")),
        "```",
        "",
    ]
    return "\n".join(lines)
