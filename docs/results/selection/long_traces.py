"""Selection against eviction on long traces: the full cache's sampled traces teacher-forced through every cache.

Usage: long_traces.py OUT.jsonl [--model M] [--dtype D] [--problems N] [--min-tokens T] [--max-new-tokens M]
                     [--budgets 128,512] [--policies quest,seer,h2o,vase-attnv,triattention,streaming]
                     [--buffer B] [--batch R] [--seed S]

1. Traces (once, kept in OUT.jsonl and reused by every cell and every rerun): for each of the first N GSM8K
   problems, the model's own answers to the problems after it are packed into a context (each a chat turn
   of prompt and answer, sampled at temperature 0.6 with the full cache) until the context and the
   problem's prompt hold at least T tokens; then the problem's answer is sampled after it (temperature 0.6,
   full cache, up to max_new_tokens). A trace is that context, prompt and answer: more than T tokens, however
   short the answer.
2. Replays: each (policy, K) cell teacher-forces every trace (the context and prompt as the prefill, the answer
   one token a step, R rows at once) and records per problem top-1 agreement with the full cache, KL, and the
   K/V bytes held and read per decode step, measured on the cache, with the wall time of the cell.
Resumable: a rerun skips the cells already in OUT.jsonl. Summarise with summarise_long.py.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from reasonkv.cache import CacheSpec
from reasonkv.calibrate.traces import prompt_ids
from reasonkv.eval.datasets import load_dataset
from reasonkv.eval.fidelity import DEFAULT_MAX_CHUNK, _kl, teacher_force
from reasonkv.generation.loop import generate
from reasonkv.models import load_model


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _append(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _sample(model, tokenizer, prompts, max_new_tokens, seeds):
    results = generate(
        model, tokenizer, prompts, policy="full", max_new_tokens=max_new_tokens, temperature=0.6, seed=seeds
    )
    return [list(r.token_ids) for r in results]


def make_traces(model, tokenizer, args) -> list[dict]:
    problems = list(load_dataset("gsm8k"))
    prompts = [prompt_ids(tokenizer, p) for p in problems]
    context_answers: dict[int, list[int]] = {}  # problem index -> its sampled answer, when used as context
    traces = []
    for index in range(args.problems):
        context, other = [], args.problems
        while len(context) + len(prompts[index]) < args.min_tokens:  # the answer, however short, comes on top
            if other not in context_answers:
                [context_answers[other]] = _sample(model, tokenizer, [prompts[other]], args.max_new_tokens, [other])
            context += prompts[other] + context_answers[other]
            other += 1
        prompt = context + prompts[index]
        [answer] = _sample(model, tokenizer, [prompt], args.max_new_tokens, [args.seed + index])
        traces.append({"kind": "trace", "problem": problems[index].id, "prompt": prompt, "answer": answer})
        print(f"trace {index + 1}/{args.problems}: {len(prompt)} + {len(answer)} tokens", flush=True)
    return traces


def replay(model, tokenizer, traces, policy: str, budget: int, args) -> list[dict]:
    """Per trace: top-1 agreement of the cache's argmax with the full cache's (the traces are sampled, so the
    trace token is not the reference), KL(full || cache), and the K/V bytes held and read per decode step."""
    rows = []
    spec = CacheSpec.build(policy, budget, args.buffer)
    for start in range(0, len(traces), args.batch):
        batch = traces[start : start + args.batch]
        agree, kl_sum = [0] * len(batch), [0.0] * len(batch)

        def consume(offset, logits_e, logits_f, active, agree=agree, kl_sum=kl_sum):
            for r in active:
                le, lf = logits_e[r].float(), logits_f[r].float()
                agree[r] += int((le.argmax(-1) == lf.argmax(-1)).sum())
                kl_sum[r] += float(_kl(lf.log_softmax(-1), le.log_softmax(-1)).sum())

        forced = teacher_force(
            model,
            [t["prompt"] for t in batch],
            [t["answer"] for t in batch],
            spec,
            chunked=False,  # one token a step: every step selects
            max_chunk=DEFAULT_MAX_CHUNK,
            pad_id=tokenizer.pad_token_id or 0,
            consume=consume,
        )
        for r, trace in enumerate(batch):
            n, step_bytes = len(trace["answer"]), forced.step_bytes[r] or {}
            rows.append(
                {
                    "problem": trace["problem"],
                    "tokens": len(trace["prompt"]) + n,
                    "top1_agreement": agree[r] / n,
                    "kl_mean": kl_sum[r] / n,
                    "kv_bytes_held_per_step": step_bytes.get("held"),
                    "kv_bytes_read_per_step": step_bytes.get("read"),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--min-tokens", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--budgets", default="128,512")
    parser.add_argument("--policies", default="quest,seer,h2o,vase-attnv,triattention,streaming")
    parser.add_argument("--buffer", type=int, default=32)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device="cpu", attn_implementation="sdpa")
    done = _records(args.out)
    traces = [r for r in done if r["kind"] == "trace"]
    if not traces:
        began = time.perf_counter()
        traces = make_traces(model, tokenizer, args)
        for t in traces:
            _append(args.out, {**t, "seconds": time.perf_counter() - began})
    cells = {(r["policy"], r["budget"]) for r in done if r["kind"] == "cell"}
    for budget in [int(b) for b in args.budgets.split(",")]:
        for policy in args.policies.split(","):
            if (policy, budget) in cells:
                continue
            began = time.perf_counter()
            rows = replay(model, tokenizer, traces, policy, budget, args)
            seconds = time.perf_counter() - began
            _append(args.out, {"kind": "cell", "policy": policy, "budget": budget, "seconds": seconds, "rows": rows})
            top1 = sum(r["top1_agreement"] for r in rows) / len(rows)
            print(f"{policy} K={budget}: top-1 {top1:.3f} over {len(rows)} traces ({seconds:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
