"""Per-step cost and bytes held per layer under each allocation, ragged storage against heads padded to the
widest, on one model: greedy decode of one prompt, the mean decode step of the best of ``--repeats`` rounds
(each round runs every variant once, in turn, so that a slower spell of a shared machine falls on all of them),
the K/V bytes each evicting layer allocates at the end (read from its tensors) and the eviction phases.

    python scripts/budgets_bench.py --model smollm2-135m --policies snapkv,h2o --budget 64 --buffer 16 \
        --steps 200 --out docs/results/budgets
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import reasonkv
from reasonkv.cache import CacheSpec
from reasonkv.models import load_model

PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May? Think step by step, and check the answer twice."
)
VARIANTS = [
    ("uniform", True),
    ("pyramid", True),
    ("pyramid", False),
    ("adaptive", True),
    ("adaptive", False),
]


def layer_bytes(cache) -> list[int]:
    """Bytes of K/V each evicting layer allocates (its buffers, padding and room included)."""
    out = []
    for index in cache.full_layers:
        layer = cache.layers[index]
        keys, values = layer._keys, layer._values
        out.append(keys.numel() * keys.element_size() + values.numel() * values.element_size())
    return out


def run_one(model, tokenizer, policy: str, allocation: str, ragged: bool, args, best: dict | None) -> dict:
    """One run of a variant; the faster of it and ``best``."""
    spec = CacheSpec.build(policy, args.budget, args.buffer, allocation=allocation, ragged=ragged)
    captured = {}

    def keep(step, cache, captured=captured):
        captured["cache"] = cache

    [result] = reasonkv.generate(
        model, tokenizer, [PROMPT], spec=spec, max_new_tokens=args.steps, ignore_eos=True, on_step=keep
    )
    stats = result.stats
    step_ms = 1000 * stats["decode_seconds"] / max(1, result.num_tokens - 1)
    row = {
        "policy": policy,
        "allocation": allocation,
        "storage": "dense" if allocation == "uniform" else "ragged" if ragged else "padded",
        "step_ms": step_ms,
        "evictions": stats["evictions"],
        "peak_kv_bytes_allocated": stats["peak_kv_bytes_allocated"],
        "layer_bytes_end": layer_bytes(captured["cache"]),
        "timings_s": stats["timings"],
        "tokens": result.num_tokens,
    }
    if best is None or row["step_ms"] < best["step_ms"]:
        best = row
    return best


def markdown(rows: list[dict], args) -> str:
    lines = [
        f"Model {args.model}, K = {args.budget}, B = {args.buffer}, {args.steps} greedy steps of one prompt, "
        f"{args.threads} CPU thread(s), the best of {args.repeats} runs. Bytes: K and V every evicting layer "
        "allocates, read from its tensors (fp32).",
        "",
        "| policy | allocation | storage | ms / step | vs uniform | evictions | peak K/V bytes allocated | "
        "bytes per layer at the end (first, middle, last) | gather s | score s |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        uniform = next(r for r in rows if r["policy"] == row["policy"] and r["allocation"] == "uniform")
        per_layer = row["layer_bytes_end"]
        ends = f"{per_layer[0]:,} / {per_layer[len(per_layer) // 2]:,} / {per_layer[-1]:,}"
        lines.append(
            f"| {row['policy']} | {row['allocation']} | {row['storage']} | {row['step_ms']:.1f} | "
            f"{row['step_ms'] / uniform['step_ms']:.2f} | {row['evictions']} | {row['peak_kv_bytes_allocated']:,} | "
            f"{ends} | {row['timings_s'].get('gather', 0):.2f} | {row['timings_s'].get('score', 0):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default="snapkv,h2o")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    variants = [(policy, allocation, ragged) for policy in args.policies.split(",") for allocation, ragged in VARIANTS]
    best: dict = {}
    for round_ in range(args.repeats):
        for variant in variants:
            best[variant] = run_one(model, tokenizer, *variant, args, best.get(variant))
            row = {k: v for k, v in best[variant].items() if k != "layer_bytes_end"}
            print(json.dumps({"round": round_, **row}), flush=True)
    rows = [best[variant] for variant in variants]
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor()},
        "rows": rows,
    }
    (args.out / "bench.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "bench.md").write_text(markdown(rows, args))


if __name__ == "__main__":
    main()
