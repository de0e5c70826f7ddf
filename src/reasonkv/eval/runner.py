"""The evaluation grid: datasets x policies x budgets x samples, written record by record, resumable.

:func:`run_grid` decodes, grades and appends one generation record per (problem, policy, budget, sample),
then with ``fidelity`` one fidelity record per (problem, evicting policy, budget) (:mod:`reasonkv.eval.fidelity`).
A rerun skips the records already in the run's files, so a killed run loses nothing. The grid is split across
processes by expected cost (:mod:`reasonkv.eval.units`, :mod:`reasonkv.eval.shards`); the first record of a
results file is the run manifest (:mod:`reasonkv.eval.manifest`), and only this tool's own results files are
written to (:mod:`reasonkv.runs.outputs`). Everything that needs no model is checked before the model loads.
The work order, the seeds and every record's fields: docs/records.md; sharding, locks and resuming:
docs/eval-at-scale.md.
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
    grid["datasets"] = [{**d, "file": portable_path(d["file"], folder)} for d in grid["datasets"]]
    return build_manifest(
        setup=setup,
        environment=environment(ctx.device),
        grid=grid,
        command=None if command is None else portable_argv(command, folder),
        world_size=plan.shard.count,
        code=None
        if ctx.grader is None
        else {**ctx.grader.describe(), "after": plan.grid.code.after, "before": plan.grid.code.before},
    )


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
    """Run (or resume) an evaluation grid, or this process's shard of it, and append its records to ``out``.

    ``model`` is a loaded model (with its ``tokenizer``) or a name for :func:`reasonkv.load_model` (then
    ``dtype``, ``device`` and ``attn_implementation`` are used). The grid is a
    :class:`~reasonkv.eval.grid.GridSpec` or its settings as keywords (:meth:`GridSpec.build
    <reasonkv.eval.grid.GridSpec.build>`). ``model_name``: the recorded name (default: the name given, or the
    model's ``name_or_path``). ``on_record`` is called with each record once written. ``shard``: ``"I/N"`` or
    ``(I, N)``; default: from a ``torch.distributed`` launcher, else the whole grid. ``retry_errors``: run the
    units whose record is an error again. ``repair``: move the lines of the run's files that are not records
    aside (:func:`reasonkv.eval.records.repair_results`) and resume from the rest. ``command``: the command line,
    for the manifest.
    """
    plan = plan_grid(grid, shard=shard, **settings)  # everything that needs no model, checked before it loads
    out = Path(out)
    grader = _grader(plan)  # a sandbox that cannot run is refused before anything is created or loaded
    if isinstance(model, (str, os.PathLike)):
        model_name = model_name or os.fspath(model)
        dtype_name = _dtype_label(resolve_dtype(dtype))
    else:
        model_name = model_name or _model_name(model)
        dtype_name = _dtype_label(next(model.parameters()).dtype)
    # What every process of a sharded run must agree on (see reasonkv.eval.shards.join_run).
    agreed = {"tool": "reasonkv", "kind": "plan", "sha256": plan.description["sha256"], "grid": plan.identity()}
    lock = _join(out, plan, {**agreed, "model": model_name, "dtype": dtype_name}, repair)
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
            dtype=_dtype_label(next(model.parameters()).dtype),
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
