"""The evaluation grid: datasets x policies x budgets x samples, written record by record, resumable.

:func:`run_grid` decodes every (problem, policy, budget, sample) with :func:`reasonkv.generate`,
grades it and appends one ``"kind": "generation"`` record to a JSONL file as soon as its batch
finishes; then, with ``fidelity`` on, one ``"kind": "fidelity"`` record per (problem, evicting
policy, budget) (see :mod:`reasonkv.eval.fidelity`). Rerunning the same command skips every
record already in the file (:func:`reasonkv.eval.records.record_key` says which fields identify
one), so a killed run resumes where it stopped and loses nothing.

Work order: round by round, one batch of ``batch_size`` (problem, sample) units of every cell
(policy, budget) in turn, so a partial run covers every cell on its first problems; batching is
safe because ``reasonkv.generate`` gives each prompt the same tokens in a batch as alone. A unit
that cannot run gets an error record instead, and the rest of the grid runs (see
:mod:`reasonkv.eval.phases`).

Many processes: the grid's units are split deterministically across ``N`` shards, balanced by
expected cost (:mod:`reasonkv.eval.units`); each process writes its own shard file next to ``out``
and the last to finish merges them into ``out`` (:mod:`reasonkv.eval.shards`). Launch them with
``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; ``cuda`` becomes ``cuda:LOCAL_RANK``) or give
each its ``shard="I/N"``. Every run reads ``out`` and all its shard files, so it resumes with any
number of processes; each unit ends up exactly once in ``out``. In fp32 the records do not depend on
the number of processes; in bf16 and fp16 a prompt's tokens can depend on the batch it is decoded in
(rounding differs with the batch), and the split changes batches: there, only ``batch_size=1`` makes
the records independent of the number of processes.

Before the model loads: everything that needs no model is checked (the grid, the datasets, the output
path and its folder, the free space there, every line of the run's files), and this process joins the
run (:func:`reasonkv.eval.shards.join_run`: it takes the lock of the file it writes, refuses another
launch, a shard file of another grid, or a process of the same run with other settings).

The first record of a results file is the run manifest (:mod:`reasonkv.eval.manifest`): a run
with another setup (model, weights, dtype, sampling, ...) is refused, and an existing file that is
not a results file is never written to (:mod:`reasonkv.runs.outputs`). The file is written through
one open file whose place and content are checked at every record and at the end: a results file
removed, moved, replaced or overwritten in place while the run writes it is an error naming it, never a
success.

Seeds: sample ``s`` of problem ``p`` uses ``sample_seed(seed, p.id, s)`` (the first 31 bits of
``sha256(f"{seed}/{p.id}/{s}")``) for both its sampling and its eviction randomness, whatever the
policy, budget, batch or order: every policy sees the same random stream for a given sample (paired
comparisons), and a resumed run draws exactly what the uninterrupted one would have.
At temperature 0 a deterministic policy gives the same output for every seed, so it runs one
sample per problem; stochastic policies (``policy.stochastic``) still run ``samples``.

``full`` runs once per problem regardless of the budgets (its records have budget and buffer null).

A quantized tier (``quantized``, ``bits``) applies to every evicting cell (``full`` runs without
one): ``budget`` stays the full-precision ``K``, and the cell's label says the tier
(``snapkv+int8:112``: 112 tokens per head kept as int8 beside ``K``).

Generation records (``"kind": "generation"``)
    Identity: ``model``, ``dtype``, ``device``, ``dataset``, ``problem_id``, ``policy`` (name),
    ``policy_label`` (name plus the options set by the user, e.g. ``epikv[variant=lag]``),
    ``policy_config`` (``policy.config()``: every hyper-parameter), ``budget``, ``buffer``, ``tier``
    (``null``, or the quantized tier: ``quantized``, ``bits``, ``group_size``), ``sample``,
    ``seed`` (this sample's), ``base_seed``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``prompt_format``; ``equivalent_budget`` (the full-precision budget holding the same nominal
    K/V bytes as the cell: ``budget`` without a tier). Output: ``prompt_tokens``, ``output_tokens``
    (EOS included), ``output_text``,
    ``output_ids``, ``finish_reason`` (``eos``/``length``). Grade: ``reference_answer``,
    ``extracted_answer``, ``correct``, ``grading_method`` (extraction path), ``answer_from_thinking``.
    Collapse: ``collapse`` (the flags of :func:`reasonkv.eval.collapse_flags`) and ``collapsed``.
    Cost: ``seconds`` (wall time of the batch this record was decoded in: prefill + decode),
    ``prefill_seconds``, ``decode_seconds``, ``tokens_per_second`` (this row's tokens over the batch's
    decode time), ``batch_size``, ``compiled`` (whether its decode steps ran as a compiled graph, with
    ``--compile``; the compilation's time is not in ``decode_seconds``), ``evictions`` (this row),
    ``peak_cache_slots`` (the batch's cache),
    ``peak_row_tokens`` (most tokens this row held), ``peak_kv_bytes`` (the batch's most K/V bytes held,
    and ``peak_kv_bytes_by_tier``: ``full``, ``quantized``), ``peak_kv_bytes_allocated`` (the most allocated,
    spare capacity included), ``peak_memory_bytes`` (CUDA max
    allocated, or the process's peak RSS on CPU), ``policy_seconds`` (the batch's time in the
    policy: ``observe``, ``score``, ``gather``), ``reasonkv_version``, ``run`` (the id of the
    manifest of the run that wrote it), ``time``.

Fidelity records (``"kind": "fidelity"``), one per (problem, evicting policy, budget)
    The identity fields above (no sampling settings; ``fidelity_tokens`` instead), then
    ``trace_tokens``, ``trace_source`` (``generation``: the greedy full-cache record of this file was
    reused; ``regenerated``), ``top1_agreement``, ``top1_full_replay``, ``kl_mean``, ``kl_max``,
    ``evictions``, ``chunked``, ``steady_kv_bytes_by_tier`` and ``steady_kv_tokens`` (as generation records),
    ``kv_bytes_held_per_step`` and ``kv_bytes_read_per_step`` (the evicting layers' K/V held and read at each
    decode step of the replay, measured, mean over its steps: equal for an eviction cache, the blocks read for
    a selection one; :mod:`reasonkv.eval.step_bytes`), and for problems with a reference solution ``reference_tokens``,
    ``answer_tokens``, ``answer_logprob_full``, ``answer_logprob_evicting``, ``answer_logprob_delta``
    (evicting minus full, summed over the answer tokens), ``answer_logprob_delta_mean`` (per token),
    ``answer_evictions`` (all ``null`` without a reference); ``seconds`` (per record), ``run``, ``time``.
    The eviction seed is that of sample 0. ``full`` gets no fidelity records (it is the reference).

Error records (``"kind": "error"``), one per unit that could not be computed
    The identity fields of the unit, ``unit`` (``generation`` or ``fidelity``), ``seed``, ``stage``,
    ``error`` (the reason), ``run``, ``time``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reasonkv.eval.code import CodeGrader
from reasonkv.eval.context import Context, Ledger
from reasonkv.eval.decoding import run_generation
from reasonkv.eval.environment import environment, weights_sha256
from reasonkv.eval.grid import GridSpec
from reasonkv.eval.manifest import build_manifest, check_compatible, tokenizer_sha256
from reasonkv.eval.plan import GridPlan, has_code, plan_grid
from reasonkv.eval.records import ResultsFile, scan_results
from reasonkv.eval.replays import run_fidelity
from reasonkv.eval.shards import Shard, join_run, merge_shards, read_run, run_files, shard_files, writer_path
from reasonkv.models import load_model
from reasonkv.models.devices import resolve_dtype
from reasonkv.runs.outputs import OutputError, OutputLock, make_folder, refuse_inputs
from reasonkv.runs.paths import portable_argv, portable_path
from reasonkv.sandbox import Sandbox

__all__ = ["GridResult", "run_grid"]


@dataclass
class GridResult:
    """What :func:`run_grid` did."""

    path: Path  # the run's results file (--out)
    written_to: Path | None = None  # the file this process wrote: path, or its shard file
    shard: Shard = field(default_factory=Shard)
    generated: int = 0  # generation records written by this process
    fidelity: int = 0  # fidelity records written by this process
    errors: int = 0  # error records written by this process
    skipped: int = 0  # units of this process already in the run's files
    accuracy: dict[str, tuple[int, int]] = field(default_factory=dict)  # "dataset cell" -> (correct, total)
    fidelity_means: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # -> (top-1, KL, replays)
    complete: bool = False  # every unit of the grid has a record (result or error)
    missing: int = 0  # units of the grid without a record (other shards still running)
    failed: int = 0  # units of the grid whose record is an error (known once complete)
    merged: int | None = None  # records merged from shard files into path (None: no merge by this process)

    def summary(self) -> str:
        where = f"{self.written_to}" + (f" (shard {self.shard.label} of {self.path})" if self.shard.count > 1 else "")
        lines = [
            f"{where}: {self.generated} generation, {self.fidelity} fidelity and {self.errors} error records "
            f"written, {self.skipped} already there"
        ]
        for name in dict.fromkeys([*self.accuracy, *self.fidelity_means]):
            parts = []
            if name in self.accuracy:
                correct, total = self.accuracy[name]
                parts.append(f"accuracy {correct}/{total} = {correct / total:.3f}" if total else "accuracy -")
            if name in self.fidelity_means:
                top1, kl, replays = self.fidelity_means[name]
                parts.append(f"top-1 agreement {top1:.3f}, KL {kl:.4f} ({replays} replays)")
            lines.append(f"  {name:<40} {'; '.join(parts)}")
        if not self.complete:
            lines.append(
                f"{self.missing} units of other shards are not done yet: the last shard to finish merges every "
                f"shard into {self.path} (reasonkv report reads the shards meanwhile)"
            )
        elif self.merged is not None:
            lines.append(f"the grid is complete: {self.merged} records of the shard files merged into {self.path}")
        if self.complete and self.failed:
            lines.append(f"{self.failed} units failed (error records; rerun with --retry-errors to try them again)")
        return "\n".join(lines)


MIN_FREE_BYTES = 64 * 1024  # less free space than this where --out lives: refused before the model loads


def _dtype_label(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _dtype_name(model) -> str:
    return _dtype_label(next(model.parameters()).dtype)


def _model_name(model) -> str:
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return str(name) or type(model).__name__


def _prompt_format(tokenizer, thinking: bool | None) -> str:
    base = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    return base if thinking is None else f"{base}:thinking={'on' if thinking else 'off'}"


def _manifest(ctx: Context, plan: GridPlan, command: Sequence[str] | None, folder: Path) -> dict[str, Any]:
    """The run's manifest; the paths in it (dataset files, the command line) as the run's ``folder`` sees them
    (:func:`~reasonkv.runs.paths.portable_path`), never the machine's own."""
    config = getattr(ctx.model, "config", None)
    setup = {
        "model": ctx.model_name,
        "model_revision": getattr(config, "_commit_hash", None),
        "weights_sha256": weights_sha256(ctx.model),
        "tokenizer_sha256": tokenizer_sha256(ctx.tokenizer),
        "dtype": ctx.dtype,
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "prompt_format": ctx.prompt_format,
        **plan.sampling(),
    }
    grid = dict(plan.description)
    grid["datasets"] = [
        {**d, "file": portable_path(d["file"], folder)} if isinstance(d.get("file"), str) else d
        for d in grid["datasets"]
    ]
    return build_manifest(
        setup=setup,
        environment=environment(ctx.device),
        grid=grid,
        command=None if command is None else portable_argv(command, folder),
        world_size=plan.shard.count,
        code=None if ctx.grader is None else _code_manifest(plan.grid, ctx.grader),
    )


def _code_manifest(grid: GridSpec, grader: CodeGrader) -> dict[str, Any]:
    return {**grader.describe(), "after": grid.code.after, "before": grid.code.before}


def _grader(plan: GridPlan) -> CodeGrader | None:
    """The code grader when the grid has code problems (its sandbox checked now, before the model loads)."""
    if not any(has_code(problems) for _, problems in plan.datasets):
        return None
    settings = plan.grid.code
    return CodeGrader(
        Sandbox(allow_missing=settings.allow_missing),
        timeout=settings.timeout,
        memory_mb=settings.memory_mb,
        workers=settings.workers,
    )


def _plan_record(plan: GridPlan, model_name: str, dtype: str) -> dict[str, Any]:
    """What every process of a sharded run must agree on (see :func:`reasonkv.eval.shards.join_run`)."""
    return {
        "tool": "reasonkv",
        "kind": "plan",
        "sha256": plan.description["sha256"],
        "grid": plan.identity(),
        "model": model_name,
        "dtype": dtype,
    }


def _check_space(out: Path) -> None:
    """Refuse before the model loads when the filesystem of ``out`` is (nearly) full."""
    try:
        stat = os.statvfs(out.parent)
    except OSError:
        return
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_BYTES:
        kept = " (the records already there are kept)" if out.exists() else ""
        raise OutputError(
            f"--out {out}: its filesystem has {free:,} bytes free: free some space, then rerun the same command{kept}"
        )


# ---------------------------------------------------------------------------------- the grid


def run_grid(
    model,
    tokenizer=None,
    grid: GridSpec | None = None,
    *,
    out: str | os.PathLike[str],
    model_name: str | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    progress: bool = True,
    on_record: Callable[[dict], None] | None = None,
    shard: Shard | str | tuple[int, int] | None = None,
    retry_errors: bool = False,
    repair: bool = False,
    command: Sequence[str] | None = None,
    **settings,
) -> GridResult:
    """Run (or resume) an evaluation grid, or this process's shard of it, and append its records.

    Parameters
    ----------
    model, tokenizer
        A loaded model and its tokenizer, or a model name for :func:`reasonkv.load_model` (then
        ``tokenizer`` is ignored and ``dtype``/``device``/``attn_implementation`` are used).
    grid, settings
        The grid: a :class:`~reasonkv.eval.grid.GridSpec`, or its settings as keywords (``dataset``,
        ``policies``, ``budgets``, ``buffer``, ``samples``, ``max_new_tokens``, ...; see
        :meth:`GridSpec.build <reasonkv.eval.grid.GridSpec.build>`).
    out
        The JSONL results file of the run (a shard writes ``<out stem>.shard-I-of-N<suffix>`` next to it;
        see :mod:`reasonkv.eval.shards`). Records already in the run's files are skipped.
    model_name
        Recorded model name (default: the name given, or the model's ``name_or_path``).
    progress
        Show progress bars with ETA and the running accuracy of the current cell.
    on_record
        Called with each record right after it is written.
    shard
        This process's share: ``"I/N"`` or ``(I, N)``; default: from a ``torch.distributed`` launcher
        (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), else the whole grid.
    retry_errors
        Run again the units whose record is an error.
    repair
        Move the lines of the run's files that are not records (a hand edit) aside, to
        ``<file>.rejected-<date>``, and resume from the rest (see :func:`reasonkv.eval.records.repair_results`).
    command
        The command line, for the manifest.
    """
    plan = plan_grid(grid, shard=shard, **settings)  # everything that needs no model, checked before it loads
    out = Path(out)
    grader = _grader(plan)  # a sandbox that cannot run is refused before anything is created or loaded
    if isinstance(model, (str, os.PathLike)):
        model_name = model_name or os.fspath(model)
        dtype_name = _dtype_label(resolve_dtype(dtype))
    else:
        model_name = model_name or _model_name(model)
        dtype_name = _dtype_name(model)
    lock = _join(out, plan, _plan_record(plan, model_name, dtype_name), repair)
    try:
        if isinstance(model, (str, os.PathLike)):
            device = plan.shard.device(device)
            print(f"loading {model_name} ({dtype}, {device}, {attn_implementation}) ...", file=sys.stderr, flush=True)
            model, tokenizer = load_model(
                model,
                dtype=dtype,
                device=device,
                attn_implementation=attn_implementation,
                progress=None if progress else False,
            )
        if tokenizer is None:
            raise ValueError("the eval needs a tokenizer (shape: models have none)")
        ctx = Context(
            model=model,
            tokenizer=tokenizer,
            grid=plan.grid,
            model_name=model_name,
            dtype=_dtype_name(model),
            device=str(next(model.parameters()).device),
            prompt_format=_prompt_format(tokenizer, plan.grid.thinking),
            progress=progress,
            on_record=on_record,
            label=f"[{plan.shard.label}] " if plan.shard.count > 1 else "",
            ledger=Ledger(retry_errors=retry_errors),
            grader=grader,
        )
        _write(ctx, plan, out, lock, command)
    finally:
        lock.release()
    result = GridResult(path=out, written_to=writer_path(out, plan.shard), shard=plan.shard)
    result.generated, result.fidelity = ctx.counts["generation"], ctx.counts["fidelity"]
    result.errors, result.skipped = ctx.counts["error"], ctx.counts["skipped"]
    result.accuracy = {name: tuple(tally) for name, tally in ctx.tally.items()}
    result.fidelity_means = {
        name: (t[0] / t[2], t[1] / t[2], int(t[2])) for name, t in ctx.fidelity_tally.items() if t[2]
    }
    _finish(result, plan, ctx, ctx.ledger if plan.shard.count == 1 else None)  # a single process knows the run
    return result


def _join(out: Path, plan: GridPlan, plan_record: dict[str, Any], repair: bool) -> OutputLock:
    """Everything about the output that needs no model, before it loads (every line of the run's files is
    checked): returns the lock of the file this process writes (held)."""
    refuse_inputs([out, writer_path(out, plan.shard)], plan.dataset_files())
    for path in run_files(out):
        scan_results(path, first_only=True)  # a file that is not ours is refused before anything is created
    make_folder(out.parent, f"--out {out}")
    lock, repaired = join_run(out, plan.shard, plan_record, repair=repair)
    try:
        for note in repaired:
            print(note, file=sys.stderr, flush=True)
        for path in run_files(out):
            scan_results(path)  # a line that is not a record is named (with the repair) now, not after the load
        _check_space(out)
    except BaseException:
        lock.release()
        raise
    return lock


def _write(ctx: Context, plan: GridPlan, out: Path, lock: OutputLock, command: Sequence[str] | None) -> None:
    """Read what the run writing ``out`` holds now (other processes may have written, and merged, while the
    model loaded), then decode and replay this process's units not done yet into the file ``lock`` guards."""
    target = lock.target
    manifest = _manifest(ctx, plan, command, out.parent)
    ctx.run_id = manifest["id"]
    warned: list[str] = []

    def compatible(path: Path, manifests: list[dict]) -> None:
        differences = check_compatible(path, manifests, manifest)
        if differences and not warned:
            warned.append(path.name)
            added = "" if manifest["id"] in {m.get("id") for m in manifests} else "; this run's manifest is added"
            print(f"warning: {path} was written in another environment ({'; '.join(differences)}){added}",
                  file=sys.stderr)  # fmt: skip

    for path, manifests in read_run(out, plan.description["sha256"], ctx.ledger.note, exclude=target).items():
        compatible(path, manifests)
    ctx.results = ResultsFile(
        target, manifest, visit=ctx.ledger.note, check=lambda ms: compatible(target, ms), lock=lock
    )
    with ctx.results:
        for name, problems in plan.datasets:
            run_generation(ctx, name, problems, plan.mine())
            if plan.fidelity:
                run_fidelity(ctx, name, problems, plan.mine())


def _finish(result: GridResult, plan: GridPlan, ctx, ledger) -> None:
    """Whether the grid is complete; if so, merge the shard files into ``--out``."""
    grid = plan.description["sha256"]
    if ledger is None:  # other shards wrote too: read what the run's files hold now
        ledger = Ledger()
        read_run(result.path, grid, ledger.note)
    problems = {(name, p.id): p for name, problems in plan.datasets for p in problems}
    missing = 0
    failed = set()  # a problem's generation and fidelity units that both failed count once
    for unit in plan.units:
        problem, cell = problems[(unit.dataset, unit.problem)], plan.cells[unit.cell]
        if unit.kind == "generation":
            key = ctx.generation_key(unit.dataset, problem, cell, unit.sample).key()
        else:
            key = ctx.fidelity_key(unit.dataset, problem, cell).key()
        missing += not ledger.recorded(key)
        if ledger.failed(key):
            failed.add((unit.dataset, unit.problem, unit.cell, unit.sample))
    result.complete, result.missing, result.failed = missing == 0, missing, len(failed)
    if result.complete and shard_files(result.path):
        result.merged = merge_shards(result.path, grid)
