"""The before/after tables of this folder, from bench/{before,after}/results.jsonl and fidelity/*.jsonl.

Both trees' raw records are summarised by today's reasonkv.bench.report (so both get the same definitions,
the steady flatness included); run with the repository's src on the path:

PYTHONPATH=src python docs/benchmarks/cpu-overhead-before-after/table.py > docs/benchmarks/cpu-overhead-before-after/tables.md
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from reasonkv.bench.report import summarise
from reasonkv.bench.store import ResultStore

HERE = Path(__file__).resolve().parent
LONG = 8192


def _bench(tree: str) -> tuple[dict, dict]:
    summary = summarise(ResultStore(HERE / "bench" / tree).ok())
    sweep = summary["sweep"]["1"]
    evictions = (summary.get("eviction_cost") or {}).get("mean_s", {})
    return sweep, evictions


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _ms(seconds) -> str:
    return _fmt(None if seconds is None else 1000 * seconds, "{:.1f}")


def bench_tables() -> list[str]:
    (before, evict_before), (after, evict_after) = _bench("before"), _bench("after")
    names = [n for n in after["policies"] if n not in ("full", "transformers")]
    lines = [
        f"Steady state at {LONG} tokens and one eviction at 4096 cached tokens (K = 512, B = 128, SmolLM2-135M "
        "bf16, one thread); overhead = record + observe + score + gather per decode step as % of a full-cache step "
        "at K + B/2, over a window of 128 steps that holds one eviction; flatness = step at 4096 (8 K) / step at 512 "
        "(K, where the cache still grows from 384 to 512 slots and nothing is evicted) and / step at 1024 (the first "
        "steady length, K to K + B slots as at 4096).",
        "",
        "| policy | overhead % before | after | tokens/s vs full before | after | flatness vs K before | after "
        "| vs steady before | after | one eviction ms before | after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        b, a = before["policies"].get(name, {}), after["policies"][name]
        cells = [
            _fmt(b.get("overhead_pct", {}).get(LONG), "{:.2f}"),
            _fmt(a["overhead_pct"].get(LONG), "{:.2f}"),
            _fmt(b.get("tokens_per_s_vs_full", {}).get(LONG), "{:.2f}"),
            _fmt(a["tokens_per_s_vs_full"].get(LONG), "{:.2f}"),
            _fmt((b.get("flatness") or {}).get("ratio"), "{:.3f}"),
            _fmt((a.get("flatness") or {}).get("ratio"), "{:.3f}"),
            _fmt((b.get("flatness_steady") or {}).get("ratio"), "{:.3f}"),
            _fmt((a.get("flatness_steady") or {}).get("ratio"), "{:.3f}"),
            _ms(evict_before.get(name)),
            _ms(evict_after.get(name)),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    plain = after["policies"].get("transformers")
    if plain:
        lengths = list(after["lengths"])
        lines += [
            "",
            "After: tokens/s relative to transformers' own cache (the same loop, no reasonkv hook), and the "
            "prefill's eviction of the prompt down to K (ms):",
            "",
            "| policy | "
            + " | ".join(f"vs transformers @{n}" for n in lengths)
            + " | "
            + " | ".join(f"prefill eviction @{n}" for n in lengths)
            + " |",
            "|" + "---|" * (1 + 2 * len(lengths)),
        ]
        for name, s in after["policies"].items():
            ratios = [_fmt(s["tokens_per_s_vs_transformers"].get(n), "{:.3f}") for n in lengths]
            first = [_ms(s.get("prefill_eviction_s", {}).get(n)) for n in lengths]
            lines.append(f"| {name} | " + " | ".join(ratios + first) + " |")
    return lines


def _fidelity(tree: str) -> dict[str, dict[str, tuple[float, float]]]:
    path = HERE / "fidelity" / f"{tree}.jsonl"
    out: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "fidelity":
                out[record["policy_label"]][record["problem_id"]] = (record["top1_agreement"], record["kl_mean"])
    return out


def fidelity_tables() -> list[str]:
    trees = {tree: _fidelity(tree) for tree in ("before", "start", "after")}
    if not trees["after"]:
        return []
    lines = [
        "",
        "Fidelity (gsm8k:10, K = 128, B = 32, 256 tokens, fp32): mean top-1 agreement / mean KL per policy, and "
        "whether every record (problem) is identical to after's:",
        "",
        "| policy | before | start | after | before = after | start = after |",
        "|---|---|---|---|---|---|",
    ]
    for name, records in trees["after"].items():
        cells, same = [], []
        for tree in ("before", "start", "after"):
            rows = trees[tree].get(name)
            if not rows:
                cells.append("-")
                continue
            top1 = statistics.fmean(v[0] for v in rows.values())
            kl = statistics.fmean(v[1] for v in rows.values())
            cells.append(f"{top1:.4f} / {kl:.4f}")
        for tree in ("before", "start"):
            rows = trees[tree].get(name)
            same.append("-" if not rows else ("yes" if rows == records else "no"))
        lines.append(f"| {name} | " + " | ".join(cells + same) + " |")
    return lines


if __name__ == "__main__":
    sys.stdout.write("\n".join(bench_tables() + fidelity_tables()) + "\n")
