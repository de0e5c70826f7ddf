"""What a length sweep is checked against, and how the bench says it: only what it measured.

The targets (reported, not asserted): the step time stays flat up to ``8 K`` tokens (within 10% of the
step at ``K``, and of the first length measured in the steady state), a policy adds at most 2% to a
full-cache step, the K/V bytes stay within ``K + B`` tokens per row, ``full`` through an
``EvictingCache`` keeps within 2% of transformers' own cache, and the policies that read no attention
are at least as fast as it (a compiled entry, ``--compile``: as transformers compiled). A target whose
lengths or entries the run did not measure says so, with what it would need, instead of a verdict.
"""

from __future__ import annotations

from reasonkv.bench.compiled import COMPILED, compiled_label
from reasonkv.bench.settings import TRANSFORMERS

__all__ = [
    "EVICTION_TARGET_S",
    "TRIVIAL_POLICIES",
    "cheapest_of",
    "cheapest_text",
    "epikv_cheapest",
    "failures",
    "mark",
    "sweep_targets",
    "targets_markdown",
]

TRIVIAL_POLICIES = ("full", "streaming", "random")
FLAT_TOLERANCE = 0.10  # |step at 8 K / step at K - 1|
OVERHEAD_TARGET_PCT = 2.0
BOOKKEEPING_TOLERANCE = 0.02  # full through an EvictingCache against transformers' own cache
EVICTION_TARGET_S = 1.0  # one eviction of a few thousand cached tokens


def _flat(summary: dict, key: str) -> dict[str, float]:
    """``policy -> ratio`` of the flatness measured up to 8 K (a shorter sweep measures no flatness at 8 K)."""
    eight_k = 8 * summary["budget"]
    flats = {name: s.get(key) for name, s in summary["policies"].items() if s["evicts"]}
    return {name: f["ratio"] for name, f in flats.items() if f and f["ratio"] and f["long_length"] >= eight_k}


def sweep_targets(summary: dict) -> dict:
    """The targets of one batch size's sweep summary (see the module docstring)."""
    policies = {n: s for n, s in summary["policies"].items() if s["evicts"]}
    flat, steady = _flat(summary, "flatness"), _flat(summary, "flatness_steady")
    overhead = {n: s["overhead_pct_steady"] for n, s in policies.items() if s["overhead_pct_steady"] is not None}
    bound = {n: s["kv_within_bound"] for n, s in policies.items() if "kv_within_bound" in s}
    # Against transformers' own cache (a compiled entry: against transformers compiled): the slowest length counts.
    versus = {
        n: min(s["tokens_per_s_vs_transformers"].values())
        for n, s in summary["policies"].items()
        if s.get("tokens_per_s_vs_transformers") and n not in (TRANSFORMERS, compiled_label(TRANSFORMERS))
    }
    full = versus.get("full")
    return {
        "eight_k": 8 * summary["budget"],
        "longest_length": max(summary["lengths"], default=None),
        "flat_within_10pct": {n: abs(v - 1.0) <= FLAT_TOLERANCE + 1e-12 for n, v in flat.items()},
        "flat_steady_within_10pct": {n: abs(v - 1.0) <= FLAT_TOLERANCE + 1e-12 for n, v in steady.items()},
        "overhead_target_pct": OVERHEAD_TARGET_PCT,
        "overhead_within_target": {n: v <= OVERHEAD_TARGET_PCT for n, v in overhead.items()},
        "kv_within_bound": bound,
        **cheapest_of(overhead),
        "full_vs_transformers": full,
        "full_within_2pct_of_transformers": None if full is None else full >= 1.0 - BOOKKEEPING_TOLERANCE,
        "attention_free_at_least_transformers": {
            n: v >= 1.0 for n, v in versus.items() if n in policies and policies[n].get("reads_attention") is False
        },
    }


def cheapest_of(costs: dict[str, float]) -> dict:
    """The cheapest policy that scores tokens, and whether it is EPIKV (:func:`epikv_cheapest`). It is a policy's,
    decoded eagerly: a compiled variant is the same policy in another engine."""
    nontrivial = {n: v for n, v in costs.items() if n not in TRIVIAL_POLICIES and not n.endswith(COMPILED)}
    cheapest = min(nontrivial, key=nontrivial.get) if nontrivial else None
    return {"cheapest_nontrivial": cheapest, "epikv_cheapest": epikv_cheapest(cheapest, nontrivial)}


def epikv_cheapest(cheapest: str | None, candidates: dict) -> bool | None:
    """Whether the cheapest candidate is EPIKV or one of its variants (None: no EPIKV among the candidates)."""
    if cheapest is None or not any(n.startswith("epikv") for n in candidates):
        return None
    return cheapest.startswith("epikv")


def cheapest_text(cheapest: str, epikv: bool | None) -> str:
    """``Cheapest policy that scores tokens: X`` (and whether it is EPIKV, when EPIKV was measured)."""
    text = f"Cheapest policy that scores tokens (besides {', '.join(TRIVIAL_POLICIES)}): {cheapest}"
    if epikv is False:
        text += " (EPIKV, measured too, is not the cheapest)"
    return text


def failures(flags: dict, missing: str = "not measured") -> str:
    """``all met``, ``missed by A, B``, or ``missing`` when nothing was measured."""
    if not flags:
        return missing
    bad = [n for n, ok in flags.items() if not ok]
    return "all met" if not bad else "missed by " + ", ".join(bad)


def mark(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def targets_markdown(targets: dict) -> list[str]:
    """The targets as markdown bullets: a verdict for what was measured, what is missing for the rest."""
    target = targets["overhead_target_pct"]
    eight_k, longest = targets.get("eight_k"), targets.get("longest_length")
    short = f"not measured: the longest length, {longest}, is below 8 K = {eight_k} (add it to --lengths)"
    lines = [
        "Targets (reported, not asserted):",
        "",
        f"- step time at 8 K within +-10% of the step at K: {failures(targets['flat_within_10pct'], short)}",
        "- step time flat beyond K + B (8 K within +-10% of the first steady length): "
        + failures(targets.get("flat_steady_within_10pct", {}), short),
        f"- eviction overhead <= {target:g}% of a full step (steady): {failures(targets['overhead_within_target'])}",
        f"- KV bytes allocated within (K + B) tokens per row: {failures(targets['kv_within_bound'])}",
    ]
    if targets.get("cheapest_nontrivial"):
        lines.append("- " + cheapest_text(targets["cheapest_nontrivial"], targets.get("epikv_cheapest")))
    full = targets.get("full_vs_transformers")
    if full is not None:
        ok = mark(targets["full_within_2pct_of_transformers"])
        lines += [
            f"- full through an EvictingCache within 2% of transformers' own cache: {ok} ({full:.3f}x at the "
            "slowest length)",
            "- policies that read no attention at least as fast as transformers' own cache: "
            + failures(targets["attention_free_at_least_transformers"], "none of them measured"),
        ]
    return lines + [""]
