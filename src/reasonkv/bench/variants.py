"""The length sweep's variants against their plain entries: tiered (:mod:`reasonkv.bench.tiers`), compiled
(:mod:`reasonkv.bench.compiled`) and ragged (``--ragged``).

A ragged variant ``POLICY~ragged`` runs the policy with its rows prefilled to lengths ``B / batch`` apart, so that
they evict at different steps, as prompts of different lengths do; the plain entry's rows evict together.
"""

from __future__ import annotations

from reasonkv.bench.compiled import compiled_markdown, compiled_summary
from reasonkv.bench.markdown import per_batch
from reasonkv.bench.tiers import tier_markdown, tier_summary
from reasonkv.bench.windows import beside_plain, ratios, unsuffixed

__all__ = ["RAGGED", "ragged_label", "ragged_markdown", "ragged_summary", "variant_markdown", "variant_summaries"]

RAGGED = "~ragged"


def ragged_label(policy: str) -> str:
    """``snapkv~ragged``: the name a ragged variant is measured and reported under."""
    return policy + RAGGED


def _gather_share(window: dict) -> float:
    step = window["step_mean_s"]
    return window["split_s"].get("gather", 0.0) / step if step > 0 else float("nan")


def ragged_summary(records: list[dict]) -> dict:
    """Per batch (as a string) and ragged variant: step time over the plain entry's, evictions in the window
    and the share of a step spent compacting, for both, at each length they share."""
    out: dict = {}
    for record, plain, mine, theirs, common in beside_plain(records, unsuffixed(RAGGED)):
        out.setdefault(str(record["batch"]), {})[record["policy"]] = {
            "policy": plain["policy"],
            "step_vs_lockstep": ratios(mine, theirs, common, "step_mean_s"),
            "evictions": {n: mine[n]["evictions"] for n in common},
            "lockstep_evictions": {n: theirs[n]["evictions"] for n in common},
            "gather_share": {n: _gather_share(mine[n]) for n in common},
            "lockstep_gather_share": {n: _gather_share(theirs[n]) for n in common},
        }
    return out


def ragged_markdown(summary: dict) -> list[str]:
    """The comparison as markdown tables, one per batch size."""
    return per_batch(
        summary,
        "Rows evicting at different steps against rows evicting together",
        "The ragged variant's rows are prefilled to lengths B / batch apart: more evictions, each of fewer "
        "rows. Step time relative to the rows evicting together, evictions in the window (eviction events: "
        "rows evicting together count once) and the share of a step spent compacting the cache (gather).",
        ["variant", "length", "step vs together", "evictions (together)", "gather share (together)"],
        _ragged_rows,
    )


def _ragged_rows(variants: dict) -> list[list[str]]:
    rows = []
    for label, s in variants.items():
        for n, ratio in s["step_vs_lockstep"].items():
            evictions = f"{s['evictions'][n]} ({s['lockstep_evictions'][n]})"
            gather = f"{100 * s['gather_share'][n]:.2f}% ({100 * s['lockstep_gather_share'][n]:.2f}%)"
            rows.append([label, str(n), f"{ratio:.3f}", evictions, gather])
    return rows


def variant_summaries(records: list[dict]) -> dict:
    """The summaries of every kind of variant: ``{"tiers": ..., "ragged": ..., "compiled": ...}``."""
    return {"tiers": tier_summary(records), "ragged": ragged_summary(records), "compiled": compiled_summary(records)}


def variant_markdown(summary: dict) -> list[str]:
    """The comparisons as markdown (nothing for a run without variants)."""
    lines = tier_markdown(summary.get("tiers") or {}) + ragged_markdown(summary.get("ragged") or {})
    return lines + compiled_markdown(summary.get("compiled") or {})
