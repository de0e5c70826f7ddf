"""The fidelity phase of a grid: replay the full cache's greedy trace of each problem through every
evicting cell (:mod:`reasonkv.eval.fidelity`) and write one record per (problem, cell).

The traces come from the grid's own greedy ``full`` generations when the run's files hold them, else
they are generated here (once per problem). Failures are recorded per unit, as in the generation phase.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from reasonkv.eval import fidelity
from reasonkv.eval.context import Context, attempt, chunks, now, progress, reason
from reasonkv.eval.datasets import Problem
from reasonkv.eval.decoding import refused_prompt, steady_bytes_fields
from reasonkv.eval.grid import Cell
from reasonkv.eval.record_kinds import FidelityRecord
from reasonkv.eval.units import Unit, sample_seed
from reasonkv.generation import generate

__all__ = ["run_fidelity"]

#: The fields of a fidelity record that copy the replay's :class:`~reasonkv.eval.fidelity.TraceFidelity`.
_TRACE_FIELDS = ("top1_agreement", "top1_full_replay", "kl_mean", "kl_max", "evictions", "chunked")


def run_fidelity(ctx: Context, dataset: str, problems: Sequence[Problem], mine: set[Unit]) -> None:
    """Replay this process's fidelity units of ``dataset`` that are not done yet (evicting cells only)."""
    grid = ctx.grid
    pending: list[tuple[Cell, Problem]] = []
    for index, cell in enumerate(grid.cells):
        if not cell.evicts:
            continue
        for problem in problems:
            if Unit("fidelity", dataset, problem.id, index) not in mine:
                continue
            key = ctx.fidelity_key(dataset, problem, cell)
            if ctx.ledger.settled(key.key()):
                ctx.counts["skipped"] += 1
                ctx.note_fidelity(dataset, cell, ctx.ledger.outcomes.get(key.key()))
                continue
            why = refused_prompt(cell, len(ctx.prompt_ids(problem)), grid.replay_tokens, ctx.context)
            if why is not None:
                ctx.error(key, why, "fidelity", sample_seed(grid.seed, problem.id, 0))
            else:
                pending.append((cell, problem))
    if not pending:
        return
    traces, sources = _traces(ctx, dataset, problems, pending)
    pending = [(c, p) for c, p in pending if p.id in traces]
    needed = {p.id: p for _, p in pending}
    references = {pid: fidelity.reference_continuation(ctx.tokenizer, p) for pid, p in needed.items()}
    with progress(len(pending), f"{ctx.label}{dataset} fidelity", ctx.progress) as bar:
        for cell in dict.fromkeys(c for c, _ in pending):
            cell_problems = [p for c, p in pending if c == cell]
            cell_problems.sort(key=lambda p: len(ctx.prompt_ids(p)) + len(traces[p.id]))
            for batch in chunks(cell_problems, grid.batch_size):
                bar.set_postfix_str(cell.name, refresh=False)

                def replay(items: list[Problem], c=cell) -> list[FidelityRecord]:
                    return _fidelity_batch(ctx, dataset, c, items, traces, sources, references)

                for problem, record in attempt(replay, list(batch)):
                    if isinstance(record, Exception):
                        seed = sample_seed(grid.seed, problem.id, 0)
                        ctx.error(ctx.fidelity_key(dataset, problem, cell), reason(record), "fidelity", seed)
                    else:
                        ctx.emit(record)
                        ctx.note_fidelity(dataset, cell, record.outcome())
                    bar.update(1)


def _traces(ctx: Context, dataset: str, problems: Sequence[Problem], pending: list[tuple[Cell, Problem]]):
    """The full cache's greedy trace of every problem ``pending`` needs, and where each came from."""
    grid = ctx.grid
    needed = {p.id: p for _, p in pending}
    traces: dict[str, list[int]] = {}
    for pid in needed:
        found = ctx.ledger.traces.get((dataset, pid))
        # A shorter greedy run is a prefix of a longer one only if it stopped on its own.
        if found is not None and (len(found[0]) >= grid.replay_tokens or found[1] != "length"):
            traces[pid] = found[0][: grid.replay_tokens]
    sources = dict.fromkeys(traces, "generation")
    missing = [p for p in problems if p.id in needed and p.id not in traces]

    def regenerate(batch: list[Problem]) -> list:
        prompts = [ctx.prompt_ids(p) for p in batch]
        outs = generate(ctx.model, ctx.tokenizer, prompts, policy="full", max_new_tokens=grid.replay_tokens)
        return [list(out.token_ids) for out in outs]

    with progress(len(missing), f"{ctx.label}{dataset} full-cache traces", ctx.progress) as bar:
        for batch in chunks(missing, grid.batch_size):
            for problem, out in attempt(regenerate, list(batch)):
                if isinstance(out, Exception):
                    for cell in [c for c, p in pending if p.id == problem.id]:
                        seed = sample_seed(grid.seed, problem.id, 0)
                        ctx.error(ctx.fidelity_key(dataset, problem, cell), reason(out), "full-cache trace", seed)
                else:
                    traces[problem.id] = out
                    sources[problem.id] = "regenerated"
                bar.update(1)
    return traces, sources


def _fidelity_batch(ctx: Context, dataset, cell: Cell, batch, traces, sources, references) -> list[FidelityRecord]:
    grid = ctx.grid
    seeds = [sample_seed(grid.seed, p.id, 0) for p in batch]
    pad = getattr(ctx.tokenizer, "pad_token_id", None)
    replay = dict(max_chunk=grid.max_chunk or fidelity.DEFAULT_MAX_CHUNK, pad_id=0 if pad is None else int(pad))
    t0 = time.perf_counter()
    spec = cell.spec.replace(seed=tuple(seeds))
    trace_rows = fidelity.trace_fidelity(
        ctx.model, [ctx.prompt_ids(p) for p in batch], [traces[p.id] for p in batch], spec=spec, **replay
    )
    with_ref = [i for i, p in enumerate(batch) if references[p.id] is not None]
    answers: dict[int, Any] = {}
    if with_ref:
        rows = fidelity.answer_logprob(
            ctx.model,
            [ctx.prompt_ids(batch[i]) for i in with_ref],
            [references[batch[i].id] for i in with_ref],
            spec=cell.spec.replace(seed=tuple(seeds[i] for i in with_ref)),
            **replay,
        )
        answers = dict(zip(with_ref, rows, strict=True))
    seconds = (time.perf_counter() - t0) / len(batch)
    records = []
    for i, problem in enumerate(batch):
        tf, ans = trace_rows[i], answers.get(i)
        record = ctx.fidelity_key(dataset, problem, cell).with_fields(
            seed=seeds[i],
            equivalent_budget=ctx.equivalent_budget(cell),
            prompt_tokens=len(ctx.prompt_ids(problem)),
            trace_tokens=tf.steps,
            trace_source=sources[problem.id],
            **{name: getattr(tf, name) for name in _TRACE_FIELDS},
            **steady_bytes_fields(tf.steady_kv_bytes),
            kv_bytes_held_per_step=None if tf.step_bytes is None else round(tf.step_bytes["held"], 1),
            kv_bytes_read_per_step=None if tf.step_bytes is None else round(tf.step_bytes["read"], 1),
            reference_tokens=ans.reference_tokens if ans else None,
            answer_tokens=ans.answer_tokens if ans else None,
            answer_logprob_full=ans.logprob_full if ans else None,
            answer_logprob_evicting=ans.logprob_evicting if ans else None,
            answer_logprob_delta=ans.delta_sum if ans else None,
            answer_logprob_delta_mean=ans.delta_mean if ans else None,
            answer_evictions=ans.evictions if ans else None,
            seconds=seconds,
            batch_size=len(batch),
            run=ctx.run_id,
            time=now(),
        )
        records.append(record)
    return records
