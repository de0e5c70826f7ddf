"""The length sweep's compiled variants (``--compile``): each policy decoded eagerly and compiled, side by side.

A compiled variant ``POLICY~compiled`` runs the policy's decode steps as one fixed-shape graph each, the
evictions between them eager; its reference is ``transformers~compiled`` (a ``StaticCache`` and
``torch.compile`` of the model's forward, as transformers compiles decoding). The time spent compiling is
reported apart, never inside tokens/s.
"""

from __future__ import annotations

from reasonkv.bench.markdown import cell, per_batch
from reasonkv.bench.rounds import same_rounds
from reasonkv.bench.windows import beside, by_length, ratios, unsuffixed

__all__ = ["COMPILED", "compiled_label", "compiled_markdown", "compiled_summary"]

COMPILED = "~compiled"


def compiled_label(entry: str) -> str:
    """``snapkv~compiled``: the name a compiled variant is measured and reported under."""
    return entry + COMPILED


def compiled_summary(records: list[dict]) -> dict:
    """Per batch (as a string) and compiled variant: tokens/s eager and compiled at each length both reached,
    compiled over eager, compiled over ``transformers~compiled``, and the compilation (warm-up seconds,
    graphs, and why a cache decoded eagerly, if it did)."""
    sweeps = [r for r in records if r.get("mode") == "sweep"]
    find = {(r["policy"], r["batch"]): r for r in sweeps}  # the last record of each policy and batch
    out: dict = {}
    for record in sweeps:
        policy = unsuffixed(COMPILED)(record)
        eager = None if policy is None else find.get((policy, record["batch"]))
        if eager is None or not same_rounds(record, eager):  # a ratio only between entries of the same rounds
            continue
        mine, theirs = by_length(record), by_length(eager)
        common = sorted(set(mine) & set(theirs))
        static = beside(record, find.get(("transformers" + COMPILED, record["batch"])))
        compile_info = record.get("compile") or {}
        out.setdefault(str(record["batch"]), {})[record["policy"]] = {
            "policy": policy,
            "eager_tokens_per_s": {n: theirs[n]["tokens_per_s"] for n in common},
            "compiled_tokens_per_s": {n: mine[n]["tokens_per_s"] for n in common},
            "compiled_vs_eager": ratios(mine, theirs, common, "tokens_per_s"),
            "vs_transformers_compiled": ratios(mine, static, [n for n in common if n in static], "tokens_per_s"),
            **{key: compile_info.get(key) for key in ("warmup_seconds", "compilations", "eager_reason")},
        }
    return out


def compiled_markdown(summary: dict) -> list[str]:
    """The comparison as markdown tables, one per batch size, and a sentence per cache that ran eagerly."""
    return per_batch(
        summary,
        "Compiled against eager decoding",
        "Tokens/s of each entry's decode steps run eagerly and as one compiled graph per step, in the same "
        "run. The steps that compiled a graph are left out of tokens/s; their time is the warm-up. The last "
        "column sets the compiled entry against plain transformers compiled (a StaticCache and torch.compile "
        "of the model's forward) at the same length.",
        [
            "entry",
            "length",
            "eager tok/s",
            "compiled tok/s",
            "compiled / eager",
            "warm-up s (graphs)",
            "vs transformers~compiled",
        ],
        _compiled_rows,
        notes=lambda variants: [
            f"{label} decoded eagerly: {s['eager_reason']}." for label, s in variants.items() if s["eager_reason"]
        ],
    )


def _compiled_rows(variants: dict) -> list[list[str]]:
    rows = []
    for s in variants.values():
        warmup = f"{cell(s['warmup_seconds'], '{:.1f}')} ({cell(s['compilations'], '{}')})"
        for n, ratio in s["compiled_vs_eager"].items():
            eager, graph = s["eager_tokens_per_s"][n], s["compiled_tokens_per_s"][n]
            vs = cell(s["vs_transformers_compiled"].get(n), "{:.3f}")
            rows.append([s["policy"], str(n), f"{eager:.1f}", f"{graph:.1f}", f"{ratio:.3f}", warmup, vs])
    return rows
