"""README.md's tables from lm-eval's outputs: one folder per policy (runs/POLICY), the first the full cache;
with --hf FOLDER, also the full cache against lm-eval's own ``hf`` model on the same requests.

python summarize.py runs/full runs/streaming runs/h2o --hf runs/hf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean

GENERATE, REFERENCE = "reasonkv_gsm8k", "reasonkv_gsm8k_reference"


def load(folder: str) -> tuple[dict, dict[str, list[dict]]]:
    [results] = Path(folder).rglob("results_*.json")
    samples = {}
    for task in (GENERATE, REFERENCE):
        [path] = Path(folder).rglob(f"samples_{task}_[0-9]*.jsonl")  # the date follows the task's name
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        samples[task] = sorted(rows, key=lambda row: row["doc_id"])
    return json.loads(results.read_text(encoding="utf-8")), samples


def statistics(sample: dict) -> dict:
    """reasonkv's statistics of a logged sample: the last argument of its (one) request."""
    [arguments] = sample["arguments"].values()
    [row] = list(arguments.values())[-1]["reasonkv"]
    return row


def logprob(sample: dict) -> float:
    [[(value, _)]] = sample["resps"]  # the samples file writes numbers as text
    return float(value)


def policies(folders: list[str]) -> None:
    runs = [load(folder) for folder in folders]
    _, base = runs[0]
    header = ["policy", "K / B", "exact match", "outputs identical to full", "evictions per output"]
    header += ["peak K/V MB (generation)", "reference log-prob", "Δ vs full", "evictions per reference"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for results, samples in runs:
        settings = results["config"]["reasonkv"]
        gen, ref = samples[GENERATE], samples[REFERENCE]
        same = sum(a["resps"] == b["resps"] for a, b in zip(gen, base[GENERATE], strict=True))
        values = [logprob(row) for row in ref]
        delta = [a - logprob(b) for a, b in zip(values, base[REFERENCE], strict=True)]
        sizes = "–" if settings["budget"] is None else f"{settings['budget']} / {settings['buffer']}"
        print(
            f"| {settings['policy']} | {sizes} | {results['results'][GENERATE]['exact_match,none']:.2f} | "
            f"{same}/{len(gen)} | {mean(statistics(s)['evictions'] for s in gen):.1f} | "
            f"{max(statistics(s)['peak_kv_bytes'] for s in gen) / 1e6:.1f} | {mean(values):.2f} | "
            f"{mean(delta):+.2f} | {mean(statistics(s)['evictions'] for s in ref):.1f} |"
        )


def against_hf(full_folder: str, hf_folder: str) -> None:
    """reasonkv with the full cache against lm-eval's ``hf`` model: generations, log-likelihoods, metrics."""
    (ours, mine), (theirs, hf) = load(full_folder), load(hf_folder)
    same = sum(a["resps"] == b["resps"] for a, b in zip(mine[GENERATE], hf[GENERATE], strict=True))
    pairs = list(zip(mine[REFERENCE], hf[REFERENCE], strict=True))
    largest = max(abs(logprob(a) - logprob(b)) for a, b in pairs)
    greedy = sum(a["resps"][0][0][1] == b["resps"][0][0][1] for a, b in pairs)
    print(f"generations identical to hf: {same}/{len(mine[GENERATE])}")
    print(f"largest |log-likelihood difference| to hf: {largest:.1e} over {len(pairs)} reference solutions")
    print(f"greedy flags identical to hf: {greedy}/{len(pairs)}")
    for task in (GENERATE, REFERENCE):
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                print(f"{task} {metric}: reasonkv {ours['results'][task][metric]:.6f}, hf {value:.6f}")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    hf = None
    if "--hf" in arguments:
        at = arguments.index("--hf")
        hf, arguments = arguments[at + 1], arguments[:at] + arguments[at + 2 :]
    policies(arguments)
    if hf is not None:
        print()
        against_hf(arguments[0], hf)
