"""The work of a grid, unit by unit: generations, then fidelity replays, each record written when done.

A process does the units it owns (:mod:`reasonkv.eval.units`) that its run's files do not hold yet
(:class:`Ledger`). Batches group units of one cell; ``reasonkv.generate`` gives each prompt the same
tokens in a batch as alone, so the split across processes and the batching never change a result.

One bad cell does not sink a grid:

- Checked up front, before any decoding: a policy that protects the whole prompt (``protect_prompt``)
  cannot evict a prompt longer than its budget once an eviction is due (prompt + token limit - 1
  reaches ``K + B``). Such units get an error record at once and the rest of the grid runs.
- Anything that fails while decoding a batch: the batch is run again one unit at a time, and only a
  unit that fails alone gets an error record (``"kind": "error"``: the unit's identity fields,
  ``unit``, ``stage`` and ``error``, the reason).

An error record settles its unit: a rerun skips it (it would fail again) unless ``retry_errors``;
a later result for the unit replaces the error in reports and merges.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from reasonkv.eval.collapse import collapse_flags
from reasonkv.eval.datasets import Problem
from reasonkv.eval.grading import grade
from reasonkv.eval.prompts import build_prompt
from reasonkv.eval.records import ResultsFile, unit_key
from reasonkv.eval.units import Unit

__all__ = ["Context", "Ledger", "encode_prompt", "run_fidelity", "run_generation"]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt (no second BOS when the chat template already holds one)."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    ids = list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
    if not ids:
        raise ValueError("empty prompt")
    return ids


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _chunks(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    # Redrawn often on a terminal; every 30 s in a log file.
    interval = 0.5 if sys.stderr.isatty() else 30.0
    return tqdm(
        total=total, desc=desc, unit="rec", dynamic_ncols=True, mininterval=interval, disable=not enabled or total == 0
    )


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _attempt(run: Callable[[list], list], batch: list) -> list[tuple[Any, Any]]:
    """``[(item, output or exception)]``: the batch at once, or, if that fails, each item alone."""
    try:
        return list(zip(batch, run(batch), strict=True))
    except Exception as error:  # noqa: BLE001 - one failing unit must not cost the others their results
        if len(batch) == 1:
            return [(batch[0], error)]
        return [pair for item in batch for pair in _attempt(run, [item])]


# ---------------------------------------------------------------------------------- what is done


@dataclass
class Ledger:
    """What a run's files hold: finished units (with their grade), failed units, greedy full-cache traces."""

    retry_errors: bool = False
    results: dict[tuple, bool | None] = field(default_factory=dict)  # unit -> correct (None: fidelity)
    errors: dict[tuple, str] = field(default_factory=dict)  # unit -> reason
    traces: dict[tuple[str, str], tuple[list[int], str | None]] = field(default_factory=dict)

    def note(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "manifest":
            return
        key = unit_key(record)
        if kind == "error":
            self.errors[key] = str(record.get("error"))
            return
        self.results[key] = bool(record.get("correct")) if kind == "generation" else None
        ids = record.get("output_ids")
        if (
            kind == "generation"
            and record.get("policy") == "full"
            and record.get("temperature") == 0
            and record.get("sample") == 0
            and isinstance(ids, list)
            and ids
        ):
            self.traces[(record.get("dataset"), record.get("problem_id"))] = (ids, record.get("finish_reason"))

    def settled(self, key: tuple) -> bool:
        """Whether a unit needs no work: it has a result, or an error record and errors are not retried."""
        return key in self.results or (key in self.errors and not self.retry_errors)

    def recorded(self, key: tuple) -> bool:
        """Whether a unit has a record, result or error (a grid is complete when all have one)."""
        return key in self.results or key in self.errors

    def failed(self, key: tuple) -> bool:
        return key in self.errors and key not in self.results


# ---------------------------------------------------------------------------------- the context


@dataclass
class Context:
    """Everything the phases share: the model, the settings, where records go and what is done."""

    model: Any
    tokenizer: Any
    model_name: str
    dtype: str
    device: str
    prompt_format: str
    thinking: bool | None
    base_seed: int
    samples: dict[str, int]  # per dataset
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    batch_size: int
    fidelity_tokens: int
    max_chunk: int | None
    progress: bool
    on_record: Callable[[dict], None] | None
    run_id: str = ""
    label: str = ""  # shown in progress bars ("[1/4] ")
    ledger: Ledger = field(default_factory=Ledger)
    results: ResultsFile | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"generation": 0, "fidelity": 0, "error": 0, "skipped": 0})
    tally: dict[str, list[int]] = field(default_factory=dict)  # "dataset cell" -> [correct, total]
    _prompts: dict = field(default_factory=dict)
    _tiers: dict = field(default_factory=dict)

    def samples_for(self, dataset: str, cell) -> int:
        return self.samples[dataset] if (self.temperature > 0 or cell.stochastic) else 1

    def prompt_ids(self, problem: Problem) -> list[int]:
        key = (problem.id, problem.kind, problem.problem)  # ids may repeat across user files
        if key not in self._prompts:
            text = build_prompt(self.tokenizer, problem, thinking=self.thinking)
            self._prompts[key] = encode_prompt(self.tokenizer, text)
        return self._prompts[key]

    def base(self, kind: str, dataset: str, problem: Problem, cell) -> dict[str, Any]:
        return {
            "kind": kind,
            "model": self.model_name,
            "dtype": self.dtype,
            "device": self.device,
            "dataset": dataset,
            "problem_id": problem.id,
            "policy": cell.policy,
            "policy_label": cell.label,
            "policy_config": cell.config,
            "budget": cell.budget,
            "buffer": cell.buffer,
            "tier": self.tier(cell),
            "base_seed": self.base_seed,
            "prompt_format": self.prompt_format,
        }

    def tier(self, cell) -> dict[str, int] | None:
        """The cell's quantized tier as recorded (with the group size it gets on this model), or None."""
        if not cell.quantized:
            return None
        if cell not in self._tiers:
            from reasonkv.hf import model_info
            from reasonkv.cache.quantize import default_group_size

            group_size = default_group_size(model_info(self.model).head_dim)
            self._tiers[cell] = {**cell.tier, "group_size": group_size}
        return self._tiers[cell]

    def equivalent_budget(self, cell) -> float | None:
        """The full-precision budget with the cell's nominal K/V bytes (its budget without a tier)."""
        if not cell.quantized:
            return cell.budget
        from reasonkv.hf import model_info
        from reasonkv.cache.quantize import QuantFormat
        from reasonkv.cache.tiers import equivalent_budget

        tier = self.tier(cell)
        size = next(self.model.parameters()).element_size()
        fmt = QuantFormat(tier["bits"], tier["group_size"])
        return round(equivalent_budget(cell.budget, cell.quantized, fmt, model_info(self.model).head_dim, size), 2)

    def generation_key(self, dataset: str, problem: Problem, cell, sample: int) -> dict[str, Any]:
        return {
            **self.base("generation", dataset, problem, cell),
            "sample": sample,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }

    def fidelity_key(self, dataset: str, problem: Problem, cell) -> dict[str, Any]:
        return {**self.base("fidelity", dataset, problem, cell), "fidelity_tokens": self.fidelity_tokens}

    def emit(self, record: dict[str, Any]) -> None:
        """Write one record, note it done, and tell ``on_record``."""
        self.results.append(record)
        self.ledger.note(record)
        self.counts[record["kind"]] += 1
        if self.on_record is not None:
            self.on_record(record)

    def error(self, key: dict[str, Any], reason: str, stage: str, seed: int | None = None) -> None:
        """Write the error record of the unit ``key`` describes."""
        record = {"kind": "error", **{k: v for k, v in key.items() if k != "kind"}, "unit": key["kind"]}
        record.update(seed=seed, stage=stage, error=reason, run=self.run_id, time=_now())
        print(
            f"{self.label}error: {key['dataset']} {key['problem_id']} {key['policy_label']}"
            f"{'' if key['budget'] is None else '@' + str(key['budget'])}: {reason}",
            file=sys.stderr,
            flush=True,
        )
        self.emit(record)


def refused_prompt(cell, prompt_tokens: int, new_tokens: int) -> str | None:
    """Why ``cell`` cannot run a prompt of ``prompt_tokens`` for ``new_tokens`` tokens, if it cannot."""
    if not cell.evicts or not cell.config.get("protect_prompt"):
        return None
    room = cell.budget + cell.quantized  # a quantized tier holds protected tokens too
    if prompt_tokens <= room or prompt_tokens + new_tokens - 1 < cell.budget + cell.buffer:
        return None  # the prompt fits, or no eviction is ever due
    return (
        f"checked before decoding: protect_prompt keeps the whole prompt ({prompt_tokens} tokens), more than "
        f"the budget {room}; turn off protect_prompt or raise the budget"
    )


# ---------------------------------------------------------------------------------- generation


def _peak_row_tokens(prompt_tokens: int, output_tokens: int, evictions: int, cell) -> int:
    """Most tokens the row's cache held at once (exact for this cache's schedule).

    The last sampled token is never fed back, so a row stores ``prompt + output - 1`` tokens in
    all; once evicted it peaked at ``K + B`` (or at the whole prompt, if that was longer), plus the
    ``Q`` tokens of a quantized tier.
    """
    stored = prompt_tokens + max(output_tokens - 1, 0)
    if evictions == 0 or cell.budget is None:
        return stored
    return max(prompt_tokens, cell.budget + cell.buffer + cell.quantized)


def _running(name: str, tally: list[int]) -> str:
    correct, total = tally
    acc = f"{correct / total:.2f} ({correct}/{total})" if total else "-"
    return f"{name}: acc {acc}"


def run_generation(ctx: Context, dataset: str, problems: Sequence[Problem], cells: Sequence, mine: set[Unit]) -> None:
    """Decode this process's generation units of ``dataset`` that are not done yet."""
    from reasonkv.eval.runner import sample_seed

    queues: dict[int, list[tuple[Problem, int]]] = {}
    for index, cell in enumerate(cells):
        tally = ctx.tally.setdefault(f"{dataset} {cell.name}", [0, 0])
        queue = queues.setdefault(index, [])
        for problem in problems:
            for s in range(ctx.samples_for(dataset, cell)):
                if Unit("generation", dataset, problem.id, index, s) not in mine:
                    continue
                key = ctx.generation_key(dataset, problem, cell, s)
                if ctx.ledger.settled(unit_key(key)):
                    ctx.counts["skipped"] += 1
                    correct = ctx.ledger.results.get(unit_key(key))
                    if correct is not None:
                        tally[0] += correct
                        tally[1] += 1
                    continue
                reason = refused_prompt(cell, len(ctx.prompt_ids(problem)), ctx.max_new_tokens)
                if reason is not None:
                    ctx.error(key, reason, "generation", sample_seed(ctx.base_seed, problem.id, s))
                else:
                    queue.append((problem, s))
    bar = _progress(sum(map(len, queues.values())), f"{ctx.label}{dataset} generate", ctx.progress)
    try:
        # Round by round, one batch of every cell: a partial run covers every cell on its first units.
        while any(queues.values()):
            for index, cell in enumerate(cells):
                batch, queues[index] = queues[index][: ctx.batch_size], queues[index][ctx.batch_size :]
                if not batch:
                    continue
                tally = ctx.tally[f"{dataset} {cell.name}"]
                bar.set_postfix_str(_running(cell.name, tally), refresh=False)
                for (problem, s), out in _attempt(lambda items, c=cell: _decode(ctx, c, items), batch):
                    key = ctx.generation_key(dataset, problem, cell, s)
                    seed = sample_seed(ctx.base_seed, problem.id, s)
                    if isinstance(out, Exception):
                        ctx.error(key, _reason(out), "generation", seed)
                    else:
                        record = _generation_record(ctx, key, problem, cell, seed, out)
                        ctx.emit(record)
                        tally[0] += bool(record["correct"])
                        tally[1] += 1
                    bar.set_postfix_str(_running(cell.name, tally), refresh=False)
                    bar.update(1)
    finally:
        bar.close()


def _decode(ctx: Context, cell, batch: list[tuple[Problem, int]]) -> list:
    import reasonkv
    from reasonkv.eval.runner import sample_seed

    return reasonkv.generate(
        ctx.model,
        ctx.tokenizer,
        [ctx.prompt_ids(p) for p, _ in batch],
        policy=cell.make(),
        budget=cell.budget,
        buffer=cell.buffer if cell.buffer is not None else 128,
        max_new_tokens=ctx.max_new_tokens,
        temperature=ctx.temperature,
        top_p=ctx.top_p,
        top_k=ctx.top_k,
        seed=[sample_seed(ctx.base_seed, p.id, s) for p, s in batch],
        **cell.tier,
    )


def _generation_record(ctx: Context, key: dict, problem: Problem, cell, seed: int, out) -> dict[str, Any]:
    import reasonkv

    stats = out.stats
    eos_hit = out.finish_reason == "eos"
    ids = out.token_ids[:-1] if eos_hit else out.token_ids
    verdict = grade(out.text, problem)
    flags = collapse_flags(out.text, ids, max_new_tokens=ctx.max_new_tokens, eos_hit=eos_hit, kind=problem.kind)
    record = dict(key)
    record.update(
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
        prefill_seconds=stats["prefill_seconds"],
        decode_seconds=stats["decode_seconds"],
        tokens_per_second=stats["tokens_per_second"],
        batch_size=stats["batch_size"],
        evictions=stats["evictions"],
        peak_cache_slots=stats["peak_slots"],
        peak_row_tokens=_peak_row_tokens(out.prompt_tokens, out.num_tokens, stats["evictions"], cell),
        peak_kv_bytes=stats["peak_kv_bytes"],
        peak_kv_bytes_by_tier=stats.get("peak_kv_bytes_by_tier"),
        peak_memory_bytes=stats["peak_memory_bytes"],
        policy_seconds={k: float(v) for k, v in stats.get("timings", {}).items()},
        reasonkv_version=reasonkv.__version__,
        run=ctx.run_id,
        time=_now(),
    )
    return record


# ---------------------------------------------------------------------------------- fidelity


def run_fidelity(ctx: Context, dataset: str, problems: Sequence[Problem], cells: Sequence, mine: set[Unit]) -> None:
    """Replay this process's fidelity units of ``dataset`` that are not done yet (evicting cells only)."""
    import reasonkv
    from reasonkv.eval import fidelity as fid
    from reasonkv.eval.runner import sample_seed

    pending: list[tuple[Any, Problem]] = []
    for index, cell in enumerate(cells):
        if not cell.evicts:
            continue
        for problem in problems:
            if Unit("fidelity", dataset, problem.id, index) not in mine:
                continue
            key = ctx.fidelity_key(dataset, problem, cell)
            if ctx.ledger.settled(unit_key(key)):
                ctx.counts["skipped"] += 1
                continue
            reason = refused_prompt(cell, len(ctx.prompt_ids(problem)), ctx.fidelity_tokens)
            if reason is not None:
                ctx.error(key, reason, "fidelity", sample_seed(ctx.base_seed, problem.id, 0))
            else:
                pending.append((cell, problem))
    if not pending:
        return
    needed = {p.id: p for _, p in pending}
    traces: dict[str, list[int]] = {}
    for pid in needed:
        found = ctx.ledger.traces.get((dataset, pid))
        # A shorter greedy run is a prefix of a longer one only if it stopped on its own.
        if found is not None and (len(found[0]) >= ctx.fidelity_tokens or found[1] != "length"):
            traces[pid] = found[0][: ctx.fidelity_tokens]
    sources = {pid: "generation" for pid in traces}
    missing = [p for p in problems if p.id in needed and p.id not in traces]

    def regenerate(batch: list[Problem]) -> list:
        outs = reasonkv.generate(
            ctx.model, ctx.tokenizer, [ctx.prompt_ids(p) for p in batch], policy="full",
            max_new_tokens=ctx.fidelity_tokens,
        )  # fmt: skip
        return [list(out.token_ids) for out in outs]

    bar = _progress(len(missing), f"{ctx.label}{dataset} full-cache traces", ctx.progress)
    try:
        for batch in _chunks(missing, ctx.batch_size):
            for problem, out in _attempt(regenerate, list(batch)):
                if isinstance(out, Exception):
                    for cell in [c for c, p in pending if p.id == problem.id]:
                        seed = sample_seed(ctx.base_seed, problem.id, 0)
                        ctx.error(ctx.fidelity_key(dataset, problem, cell), _reason(out), "full-cache trace", seed)
                else:
                    traces[problem.id] = out
                    sources[problem.id] = "regenerated"
                bar.update(1)
    finally:
        bar.close()
    pending = [(c, p) for c, p in pending if p.id in traces]
    references = {pid: fid.reference_continuation(ctx.tokenizer, p) for pid, p in needed.items()}
    pad_id = fid._pad_id(ctx.tokenizer)
    chunk = ctx.max_chunk or fid.DEFAULT_MAX_CHUNK
    bar = _progress(len(pending), f"{ctx.label}{dataset} fidelity", ctx.progress)
    try:
        for cell in dict.fromkeys(c for c, _ in pending):
            cell_problems = [p for c, p in pending if c == cell]
            cell_problems.sort(key=lambda p: len(ctx.prompt_ids(p)) + len(traces[p.id]))
            for batch in _chunks(cell_problems, ctx.batch_size):
                bar.set_postfix_str(cell.name, refresh=False)

                def replay(items: list[Problem], c=cell) -> list[dict]:
                    return _fidelity_batch(ctx, dataset, c, items, traces, sources, references, pad_id, chunk)

                for problem, record in _attempt(replay, list(batch)):
                    if isinstance(record, Exception):
                        seed = sample_seed(ctx.base_seed, problem.id, 0)
                        ctx.error(ctx.fidelity_key(dataset, problem, cell), _reason(record), "fidelity", seed)
                    else:
                        ctx.emit(record)
                    bar.update(1)
    finally:
        bar.close()


def _fidelity_batch(ctx, dataset, cell, batch, traces, sources, references, pad_id, chunk) -> list[dict]:
    from reasonkv.eval import fidelity as fid
    from reasonkv.eval.runner import sample_seed

    seeds = [sample_seed(ctx.base_seed, p.id, 0) for p in batch]
    common = dict(budget=cell.budget, buffer=cell.buffer, max_chunk=chunk, pad_id=pad_id, **cell.tier)
    t0 = time.perf_counter()
    trace_rows = fid.trace_fidelity(
        ctx.model,
        [ctx.prompt_ids(p) for p in batch],
        [traces[p.id] for p in batch],
        policy=cell.make(),
        seeds=seeds,
        **common,
    )
    with_ref = [i for i, p in enumerate(batch) if references[p.id] is not None]
    answers: dict[int, Any] = {}
    if with_ref:
        rows = fid.answer_logprob(
            ctx.model,
            [ctx.prompt_ids(batch[i]) for i in with_ref],
            [references[batch[i].id] for i in with_ref],
            policy=cell.make(),
            seeds=[seeds[i] for i in with_ref],
            **common,
        )
        answers = dict(zip(with_ref, rows, strict=True))
    seconds = (time.perf_counter() - t0) / len(batch)
    records = []
    for i, problem in enumerate(batch):
        tf = trace_rows[i]
        ans = answers.get(i)
        record = ctx.fidelity_key(dataset, problem, cell)
        record.update(
            seed=seeds[i],
            equivalent_budget=ctx.equivalent_budget(cell),
            prompt_tokens=len(ctx.prompt_ids(problem)),
            trace_tokens=tf.steps,
            trace_source=sources[problem.id],
            top1_agreement=tf.top1_agreement,
            top1_full_replay=tf.top1_full_replay,
            kl_mean=tf.kl_mean,
            kl_max=tf.kl_max,
            evictions=tf.evictions,
            chunked=tf.chunked,
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
            time=_now(),
        )
        records.append(record)
    return records
