"""The quantized tier in the bench: each requested policy again, with a tier, at the plain K/V bytes.

``--quantized Q --bits b`` adds a variant ``POLICY+intb:Q`` of every requested evicting policy: ``Q`` tokens per
head in the tier, its full-precision budget lowered from ``K`` to the ``K'`` at which its cache holds, measured,
the K/V bytes of ``K`` plain tokens (:func:`equal_measured_bytes`).
"""

from __future__ import annotations

import math

from reasonkv.bench.markdown import cell, per_batch
from reasonkv.bench.measure import WARMUP_STEPS, model_dtype
from reasonkv.bench.memory import format_bytes, kv_bytes_per_token
from reasonkv.bench.prefilled import measure_prefilled
from reasonkv.bench.windows import beside_plain, ratios
from reasonkv.cache import CacheSpec
from reasonkv.cache.quantize import QuantFormat, default_group_size
from reasonkv.cache.tiers import budget_for_bytes
from reasonkv.hf import model_info

__all__ = ["equal_measured_bytes", "tier_label", "tier_markdown", "tier_summary", "tiered_budget"]


def tier_label(policy: str, quantized: int, bits: int) -> str:
    """``snapkv+int4:256``: the name a tiered variant is measured and reported under."""
    return f"{policy}+int{bits}:{quantized}"


def tiered_budget(model, budget: int, quantized: int, bits: int) -> dict:
    """The tier of a variant on ``model``: ``quantized``, ``bits``, ``group_size`` and the full-precision
    ``budget`` K' whose cache holds the nominal K/V bytes of ``budget`` plain tokens."""
    info = model_info(model)
    fmt = QuantFormat(bits, default_group_size(info.head_dim))
    full = budget_for_bytes(budget, quantized, fmt, info.head_dim, next(model.parameters()).element_size())
    if full < 1:
        raise ValueError(
            f"{quantized} int{bits} tokens take the K/V bytes of {budget - full} full-precision tokens, "
            f"more than the budget {budget}: lower --quantized or raise --budget"
        )
    return {"quantized": quantized, "bits": bits, "group_size": fmt.group_size, "budget": full}


def equal_measured_bytes(model, plain: CacheSpec, tier: dict, *, batch: int, prompt_length: int, **options) -> dict:
    """``tier`` (from :func:`tiered_budget`) with the full-precision budget at which the tiered cache holds,
    measured, the K/V bytes of ``plain`` (its budget ``K``, buffer ``B``): a short run of the tiered cache
    at the nominal budget (``options``: the prefill's chunk and the prompts' seed), long enough to fill the tier
    and evict once more, gives the bytes its tier allocates; the full-precision budget drops by as many tokens'
    bytes. Adds ``nominal_budget`` and ``calibration`` (the run's length and the tier's bytes)."""
    tiered = plain.replace(budget=tier["budget"], quantized=tier["quantized"], bits=tier["bits"])
    steps = plain.buffer + 1  # one eviction after the prefill's
    prefilled = tier["budget"] + tier["quantized"] + plain.buffer + prompt_length  # fills the tier at once
    length = prefilled + steps + WARMUP_STEPS
    options.update(batch=batch, length=length, decode_steps=steps, prompt_length=prompt_length, sync_timing=False)
    held = measure_prefilled(model, tiered, **options)["kv_bytes_quantized"]
    budget = plain.budget - math.ceil(held / (kv_bytes_per_token(model, model_dtype(model)) * batch))
    if budget < 1:
        raise ValueError(
            f"{tier['quantized']} int{tier['bits']} tokens hold {format_bytes(held)} measured, more than the budget "
            f"{plain.budget}: lower --quantized or raise --budget"
        )
    calibration = {"length": length, "batch": batch, "tier_bytes": held}
    return {**tier, "nominal_budget": tier["budget"], "budget": budget, "calibration": calibration}


def tier_summary(records: list[dict]) -> dict:
    """Per batch (as a string) and tiered variant: its step time and K/V bytes over the plain policy's."""
    out: dict = {}
    for record, plain, mine, theirs, common in beside_plain(records, lambda r: (r.get("tier") or {}).get("policy")):
        tier = record["tier"]
        out.setdefault(str(record["batch"]), {})[record["policy"]] = {
            "policy": tier["policy"],
            "budget": tier["budget"],
            "nominal_budget": tier.get("nominal_budget", tier["budget"]),
            **{key: tier[key] for key in ("quantized", "bits")},
            "plain_budget": plain["config"]["budget"],
            "step_vs_plain": ratios(mine, theirs, common, "step_mean_s"),
            "kv_bytes": {n: mine[n]["kv_bytes"] for n in common},
            "kv_bytes_vs_plain": ratios(mine, theirs, [n for n in common if theirs[n]["kv_bytes"]], "kv_bytes"),
        }
    return out


def tier_markdown(summary: dict) -> list[str]:
    """The comparison as markdown tables, one per batch size."""
    return per_batch(
        summary,
        "Quantized tier against the plain policy at the same K/V bytes",
        "K' full-precision + Q quantized tokens per head, K' chosen so that the measured K/V bytes equal K "
        "plain ones (the nominal K' in parentheses); step time and K/V bytes held relative to the plain "
        "policy at K, at each length.",
        ["variant", "K' (nominal) + Q (vs K)", "length", "step vs plain", "K/V held", "K/V vs plain"],
        _tier_rows,
    )


def _tier_rows(variants: dict) -> list[list[str]]:
    rows = []
    for label, s in variants.items():
        budgets = f"{s['budget']} ({s['nominal_budget']}) + {s['quantized']} int{s['bits']} (vs {s['plain_budget']})"
        for n, ratio in s["step_vs_plain"].items():
            kv = s["kv_bytes_vs_plain"].get(n)
            rows.append([label, budgets, str(n), f"{ratio:.3f}", format_bytes(s["kv_bytes"][n]), cell(kv, "{:.3f}")])
    return rows
