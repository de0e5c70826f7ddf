"""The generation phase of a grid: decode each (problem, cell, sample) unit, grade it, write its record.

Batches group units of one cell (a prompt gets the same tokens in a batch as alone). A prompt its cell
cannot run (:func:`refused_prompt`) gets an error record before any decoding; a batch that fails runs again
one unit at a time, so only a unit that fails alone gets one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import reasonkv
from reasonkv.eval.code import CodeGrade
from reasonkv.eval.collapse import collapse_flags
from reasonkv.eval.context import Context, attempt, now, progress, reason
from reasonkv.eval.datasets import Problem
from reasonkv.eval.extraction import CODE_KINDS
from reasonkv.eval.grading import grade
from reasonkv.eval.grid import Cell
from reasonkv.eval.record_kinds import GenerationRecord
from reasonkv.eval.units import Unit, sample_seed
from reasonkv.generation import GenerationResult, generate
from reasonkv.generation.context import over_context
from reasonkv.inspect.runs import Inspection, Run, token_pieces

__all__ = ["refused_prompt", "run_generation", "steady_bytes_fields"]


def refused_prompt(cell: Cell, prompt_tokens: int, new_tokens: int, context: int | None = None) -> str | None:
    """Why ``cell`` cannot run a prompt of ``prompt_tokens`` for ``new_tokens`` tokens, None when it can
    (``context``: the model's context length, when known)."""
    too_long = over_context(prompt_tokens, new_tokens, context, "shorten the problem or lower the token limit")
    if too_long is not None:
        return f"checked before decoding: {too_long}"
    if not cell.evicts or not cell.spec.policy.protect_prompt:
        return None
    room = cell.spec.room  # a quantized tier holds protected tokens too
    if prompt_tokens <= room or prompt_tokens + new_tokens - 1 < cell.spec.trigger:
        return None  # the prompt fits, or no eviction is ever due
    return (
        f"checked before decoding: protect_prompt keeps the whole prompt ({prompt_tokens} tokens), more than "
        f"the budget {room}; turn off protect_prompt or raise the budget"
    )


def _running(name: str, tally: list[int]) -> str:
    correct, total = tally
    acc = f"{correct / total:.2f} ({correct}/{total})" if total else "-"
    return f"{name}: acc {acc}"


def run_generation(ctx: Context, dataset: str, problems: Sequence[Problem], mine: set[Unit]) -> None:
    """Decode this process's generation units of ``dataset`` that are not done yet."""
    grid, cells = ctx.grid, ctx.grid.cells
    queues: dict[int, list[tuple[Problem, int]]] = {}
    for index, cell in enumerate(cells):
        tally = ctx.tally.setdefault(f"{dataset} {cell.name}", [0, 0])
        queue = queues.setdefault(index, [])
        for problem in problems:
            for s in range(grid.samples_for(dataset, cell)):
                if Unit("generation", dataset, problem.id, index, s) not in mine:
                    continue
                key = ctx.generation_key(dataset, problem, cell, s)
                if ctx.ledger.settled(key.key()):
                    ctx.counts["skipped"] += 1
                    correct = ctx.ledger.results.get(key.key())
                    if correct is not None:
                        tally[0] += correct
                        tally[1] += 1
                    continue
                why = refused_prompt(cell, len(ctx.prompt_ids(problem)), grid.sampling.max_new_tokens, ctx.context)
                if why is not None:
                    ctx.error(key, why, "generation", sample_seed(grid.seed, problem.id, s))
                else:
                    queue.append((problem, s))
    with progress(sum(map(len, queues.values())), f"{ctx.label}{dataset} generate", ctx.progress) as bar:
        # Round by round, one batch of every cell: a partial run covers every cell on its first units.
        while any(queues.values()):
            for index, cell in enumerate(cells):
                batch, queues[index] = queues[index][: grid.batch_size], queues[index][grid.batch_size :]
                if not batch:
                    continue
                tally = ctx.tally[f"{dataset} {cell.name}"]
                bar.set_postfix_str(_running(cell.name, tally), refresh=False)
                results = attempt(lambda items, c=cell: _decode(ctx, c, items), batch)
                code = _grade_code(ctx, results)
                for index, ((problem, s), out) in enumerate(results):
                    key = ctx.generation_key(dataset, problem, cell, s)
                    seed = sample_seed(grid.seed, problem.id, s)
                    if isinstance(out, Exception):
                        ctx.error(key, reason(out), "generation", seed)
                    elif isinstance(code.get(index), Exception):
                        ctx.error(key, reason(code[index]), "grading", seed)
                    else:
                        record = _generation_record(ctx, key, problem, cell, seed, out, code.get(index))
                        ctx.emit(record)
                        if problem.id in grid.trace_problems:
                            _keep_trace(ctx, dataset, problem, cell, s, out)
                        tally[0] += bool(record.correct)
                        tally[1] += 1
                    bar.set_postfix_str(_running(cell.name, tally), refresh=False)
                    bar.update(1)


def _grade_code(ctx: Context, results: list) -> dict[int, CodeGrade | Exception]:
    """The code answers of a batch, graded together (their tests run in parallel in the sandbox)."""
    items = {
        i: (out.text, problem)
        for i, ((problem, _), out) in enumerate(results)
        if problem.kind in CODE_KINDS and not isinstance(out, Exception)
    }
    if not items:
        return {}
    graded = attempt(lambda batch: ctx.grader.grade_all([item for _, item in batch]), list(items.items()))
    return {i: verdict for (i, _), verdict in graded}


def _decode(ctx: Context, cell: Cell, batch: list[tuple[Problem, int]]) -> list[GenerationResult]:
    seeds = tuple(sample_seed(ctx.grid.seed, p.id, s) for p, s in batch)
    return generate(
        ctx.model,
        ctx.tokenizer,
        [ctx.prompt_ids(p) for p, _ in batch],
        spec=cell.spec.replace(seed=seeds),
        **dataclasses.asdict(ctx.grid.sampling),
        trace=any(p.id in ctx.grid.trace_problems for p, _ in batch),
        compile=ctx.grid.compile,
    )


def _keep_trace(ctx: Context, dataset: str, problem: Problem, cell: Cell, sample: int, out: GenerationResult) -> None:
    """Write one generation's eviction trace beside the results file: ``<results>.traces/<unit>.npz``."""
    folder = ctx.results.path.with_name(ctx.results.path.stem + ".traces")
    folder.mkdir(exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{Path(dataset).stem}.{problem.id}.{cell.name}.{sample}")
    ids = ctx.prompt_ids(problem)
    run = Run(cell.name, ids, out.token_ids, token_pieces(ctx.tokenizer, ids + out.token_ids), out.trace)
    Inspection(ctx.model_name, [run]).save(folder / f"{name}.npz")


def _generation_record(
    ctx: Context,
    key: GenerationRecord,
    problem: Problem,
    cell: Cell,
    seed: int,
    out: GenerationResult,
    code: CodeGrade | None,
) -> GenerationRecord:
    stats = out.stats
    eos_hit = out.finish_reason == "eos"
    ids = out.token_ids[:-1] if eos_hit else out.token_ids
    verdict = grade(out.text, problem, complete=out.finish_reason != "length") if code is None else code
    limit = ctx.grid.sampling.max_new_tokens
    flags = collapse_flags(out.text, ids, max_new_tokens=limit, eos_hit=eos_hit, kind=problem.kind)
    record = key.with_fields(
        seed=seed,
        equivalent_budget=ctx.equivalent_budget(cell),
        prompt_tokens=out.prompt_tokens,
        output_tokens=out.num_tokens,
        output_text=out.text,
        output_ids=list(out.token_ids),
        reference_answer=problem.answer,
        extracted_answer=verdict.extracted,
        correct=verdict.correct,
        grading_method=verdict.method,
        answer_from_thinking=verdict.from_thinking,
        finish_reason=out.finish_reason,
        collapse=flags,
        collapsed=flags["collapsed"],
        seconds=stats["prefill_seconds"] + stats["decode_seconds"],
        **{name: stats[name] for name in ("prefill_seconds", "decode_seconds", "tokens_per_second", "batch_size")},
        compiled=bool(stats.get("compile", {}).get("compiled", False)),
        evictions=stats["evictions"],
        peak_cache_slots=stats["peak_slots"],
        peak_row_tokens=stats["peak_row_tokens"],
        peak_kv_bytes=stats["peak_kv_bytes"],
        peak_kv_bytes_by_tier=stats.get("peak_kv_bytes_by_tier"),
        peak_kv_bytes_allocated=stats.get("peak_kv_bytes_allocated"),
        **steady_bytes_fields(stats.get("steady_kv_bytes")),
        peak_memory_bytes=stats["peak_memory_bytes"],
        policy_seconds={k: float(v) for k, v in stats.get("timings", {}).items()},
        reasonkv_version=reasonkv.__version__,
        run=ctx.run_id,
        time=now(),
    )
    return record if code is None else record.with_fields(**code.fields())


def steady_bytes_fields(held: dict | None) -> dict[str, Any]:
    """A record's fields for the K/V a row held in steady state: bytes per tier right after its evictions
    (averaged over them) and the full-precision tokens per (layer, kv-head) those bytes would hold; None
    for a row never evicted."""
    if held is None:
        return {"steady_kv_bytes_by_tier": None, "steady_kv_tokens": None}
    by_tier = {"full": round(held["full"], 1), "quantized": round(held["quantized"], 1)}
    return {"steady_kv_bytes_by_tier": by_tier, "steady_kv_tokens": round(held["tokens"], 3)}
