"""The quantized tier in the bench: each requested policy again, with a tier, at the plain K/V bytes.

``reasonkv bench --quantized Q --bits b`` adds a variant ``POLICY+intb:Q`` of every requested
evicting policy: the same policy with ``Q`` tokens per head kept quantized and its full-precision
budget lowered from ``K`` to the ``K'`` that leaves the nominal K/V bytes of ``K`` plain tokens
(:func:`reasonkv.cache.tiers.budget_for_bytes`). Plain and tiered run side by side in one run, so the
summary compares their step time and the K/V bytes they really held.
"""

from __future__ import annotations

from reasonkv.bench.memory import format_bytes
from reasonkv.cache.quantize import QuantFormat, default_group_size
from reasonkv.cache.tiers import budget_for_bytes
from reasonkv.hf import model_info

__all__ = ["tier_label", "tier_markdown", "tier_summary", "tiered_budget"]


def tier_label(policy: str, quantized: int, bits: int) -> str:
    """``snapkv+int4:256``: the name a tiered variant is measured and reported under."""
    return f"{policy}+int{bits}:{quantized}"


def tiered_budget(model, budget: int, quantized: int, bits: int) -> dict:
    """The tier of a variant on ``model``: ``quantized``, ``bits``, ``group_size`` and the full-precision
    ``budget`` K' whose cache holds the nominal K/V bytes of ``budget`` plain tokens."""
    info = model_info(model)
    fmt = QuantFormat(bits, default_group_size(info.head_dim))
    size = next(model.parameters()).element_size()
    full = budget_for_bytes(budget, quantized, fmt, info.head_dim, size)
    if full < 1:
        raise ValueError(
            f"{quantized} int{bits} tokens take the K/V bytes of {budget - full} full-precision tokens, "
            f"more than the budget {budget}: lower --quantized or raise --budget"
        )
    return {"quantized": quantized, "bits": bits, "group_size": fmt.group_size, "budget": full}


def _by_length(record: dict) -> dict[int, dict]:
    return {int(w["length"]): w for w in record.get("windows", [])}


def tier_summary(records: list[dict]) -> dict:
    """Per batch (as a string) and tiered variant: its step time and K/V bytes over the plain policy's."""
    out: dict = {}
    sweeps = [r for r in records if r.get("mode") == "sweep"]
    for record in sweeps:
        tier = record.get("tier")
        if not tier:
            continue
        plain = next((r for r in sweeps if r["policy"] == tier["policy"] and r["batch"] == record["batch"]), None)
        if plain is None:
            continue
        mine, theirs = _by_length(record), _by_length(plain)
        common = sorted(set(mine) & set(theirs))
        out.setdefault(str(record["batch"]), {})[record["policy"]] = {
            "policy": tier["policy"],
            "budget": tier["budget"],
            "quantized": tier["quantized"],
            "bits": tier["bits"],
            "plain_budget": plain["config"]["budget"],
            "step_vs_plain": {n: mine[n]["step_mean_s"] / theirs[n]["step_mean_s"] for n in common},
            "kv_bytes": {n: mine[n]["kv_bytes"] for n in common},
            "kv_bytes_vs_plain": {
                n: mine[n]["kv_bytes"] / theirs[n]["kv_bytes"] for n in common if theirs[n]["kv_bytes"]
            },
        }
    return out


def tier_markdown(summary: dict) -> list[str]:
    """The comparison as markdown tables, one per batch size."""
    lines: list[str] = []
    for batch, variants in summary.items():
        lines += [
            f"### Quantized tier against the plain policy at the same K/V bytes (batch {batch})",
            "",
            "K' full-precision + Q quantized tokens per head, K' chosen so that the nominal bytes equal K plain "
            "ones; step time and K/V bytes held relative to the plain policy at K, at each length.",
            "",
            "| variant | K' + Q (vs K) | length | step vs plain | K/V held | K/V vs plain |",
            "|---|---|---|---|---|---|",
        ]
        for label, s in variants.items():
            for n, ratio in s["step_vs_plain"].items():
                kv = s["kv_bytes_vs_plain"].get(n)
                lines.append(
                    f"| {label} | {s['budget']} + {s['quantized']} int{s['bits']} (vs {s['plain_budget']}) | {n} | "
                    f"{ratio:.3f} | {format_bytes(s['kv_bytes'][n])} | {'-' if kv is None else f'{kv:.3f}'} |"
                )
        lines.append("")
    return lines
