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
number of processes; each unit ends up exactly once in ``out``.

The first record of a results file is the run manifest (:mod:`reasonkv.eval.manifest`): a run
with another setup (model, weights, dtype, sampling, ...) is refused, and an existing file that is
not a results file is never written to (:mod:`reasonkv.runs.outputs`).

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
    decode time), ``batch_size``, ``evictions`` (this row), ``peak_cache_slots`` (the batch's cache),
    ``peak_row_tokens`` (most tokens this row held), ``peak_kv_bytes`` (and ``peak_kv_bytes_by_tier``:
    ``full``, ``quantized``), ``peak_memory_bytes`` (CUDA max
    allocated, or the process's peak RSS on CPU), ``policy_seconds`` (the batch's time in the
    policy: ``observe``, ``score``, ``gather``), ``reasonkv_version``, ``run`` (the id of the
    manifest of the run that wrote it), ``time``.

Fidelity records (``"kind": "fidelity"``), one per (problem, evicting policy, budget)
    The identity fields above (no sampling settings; ``fidelity_tokens`` instead), then
    ``trace_tokens``, ``trace_source`` (``generation``: the greedy full-cache record of this file was
    reused; ``regenerated``), ``top1_agreement``, ``top1_full_replay``, ``kl_mean``, ``kl_max``,
    ``evictions``, ``chunked``, and for problems with a reference solution ``reference_tokens``,
    ``answer_tokens``, ``answer_logprob_full``, ``answer_logprob_evicting``, ``answer_logprob_delta``
    (evicting minus full, summed over the answer tokens), ``answer_logprob_delta_mean`` (per token),
    ``answer_evictions`` (all ``null`` without a reference); ``seconds`` (per record), ``run``, ``time``.
    The eviction seed is that of sample 0. ``full`` gets no fidelity records (it is the reference).

Error records (``"kind": "error"``), one per unit that could not be computed
    The identity fields of the unit, ``unit`` (``generation`` or ``fidelity``), ``seed``, ``stage``,
    ``error`` (the reason), ``run``, ``time``.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reasonkv.eval.datasets import Problem, load_dataset
from reasonkv.eval.records import ResultsFile, scan_results, unit_key
from reasonkv.eval.shards import Shard, lock_for_writing, merge_shards, shard_files, writer_path
from reasonkv.eval.units import Unit, assign, grid_units
from reasonkv.runs.outputs import refuse_inputs

__all__ = [
    "Cell",
    "GridPlan",
    "GridResult",
    "make_cells",
    "parse_dataset_spec",
    "parse_samples",
    "plan_grid",
    "policy_options",
    "run_grid",
    "sample_seed",
]


# ---------------------------------------------------------------------------------- planning


def sample_seed(base_seed: int, problem_id: str, sample: int) -> int:
    """The seed of sample ``sample`` of problem ``problem_id``: the first 31 bits of a SHA-256."""
    digest = hashlib.sha256(f"{int(base_seed)}/{problem_id}/{int(sample)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class Cell:
    """One (policy, budget) of the grid with the policy's options."""

    policy: str
    budget: int | None
    buffer: int | None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    stochastic: bool = False
    evicts: bool = True
    quantized: int = 0  # the quantized tier: Q tokens per head at `bits` (0: none)
    bits: int | None = None

    @property
    def label(self) -> str:
        """The policy name, with the options set on the command line and the quantized tier:
        ``epikv[variant=lag]``, ``snapkv+int4:199``."""
        label = self.policy
        if self.options:
            label += f"[{','.join(f'{k}={_fmt(v)}' for k, v in sorted(self.options.items()))}]"
        return label + (f"+int{self.bits}:{self.quantized}" if self.quantized else "")

    @property
    def tier(self) -> dict[str, int]:
        """Keyword arguments of the cache's quantized tier (empty without one)."""
        return {"quantized": self.quantized, "bits": self.bits} if self.quantized else {}

    @property
    def name(self) -> str:
        return self.label if self.budget is None else f"{self.label}@{self.budget}"

    def make(self):
        """A fresh policy instance with this cell's options.

        Passed to ``generate`` as an instance, never as keywords: a policy option may share its name
        with a sampling argument (VASE's ``temperature``).
        """
        from reasonkv.policies import get_policy

        return get_policy(self.policy, **self.options)


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "/".join(map(str, value))
    return str(value)


def parse_dataset_spec(spec: str | Sequence[str], limit: int | None = None) -> list[tuple[str, int | None]]:
    """``"gsm8k:40,math500:20"`` -> ``[("gsm8k", 40), ("math500", 20)]``; no ``:N`` means ``limit``."""
    parts = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    out: list[tuple[str, int | None]] = []
    for part in parts:
        for item in str(part).split(","):
            item = item.strip()
            if not item:
                continue
            match = re.fullmatch(r"(.+?):(-?\d+)", item)
            name, item_limit = (match.group(1), int(match.group(2))) if match else (item, limit)
            if item_limit is not None and item_limit <= 0:
                raise ValueError(f"dataset limit must be a positive integer, got {item_limit} for {name!r}")
            out.append((name, item_limit))
    if not out:
        raise ValueError("no dataset given")
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"dataset listed twice: {', '.join(names)}")
    return out


def _split_names(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else [v for item in value for v in str(item).split(",")]
    return [v.strip() for v in items if v.strip()]


def policy_options(policies: Sequence[str], pairs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Typed options per policy from ``KEY=VALUE`` / ``POLICY.KEY=VALUE`` strings (see
    :func:`reasonkv.policies.options_by_policy`)."""
    from reasonkv.policies import options_by_policy

    return options_by_policy(policies, pairs)


def make_cells(
    policies: Sequence[str],
    budgets: Sequence[int],
    buffer: int,
    options: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
    quantized: int = 0,
    bits: int | None = None,
) -> list[Cell]:
    """The grid's cells: ``full`` once (budget None) first, then every budget x evicting policy.

    Validates names, budgets and options, that each policy's protected tokens fit every budget
    (plus the quantized tier), and that with a quantized tier every evicting policy ranks tokens.
    """
    from reasonkv.policies import get_policy, policy_class
    from reasonkv.tiers import check_settings

    policies = _split_names(policies)
    if not policies:
        raise ValueError("no policy given")
    if len(set(policies)) != len(policies):
        raise ValueError(f"policy listed twice: {', '.join(policies)}")
    for p in policies:
        policy_class(p)  # unknown name: ValueError listing the valid ones
    if isinstance(options, Mapping):
        opts = {p: dict(options.get(p, {})) for p in policies}
    else:
        opts = policy_options(policies, list(options or []))
    budgets = list(budgets)
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"budgets must be positive integers, got {b!r}")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"budget listed twice: {budgets}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0:
        raise ValueError(f"buffer must be a non-negative integer, got {buffer!r}")
    evicting = [p for p in policies if policy_class(p).evicts]
    if evicting and not budgets:
        raise ValueError(f"policies {', '.join(evicting)} evict: give at least one budget")
    check_settings(quantized, bits)
    if quantized:
        bits = 8 if bits is None else bits
        unranked = [p for p in evicting if not policy_class(p).can_rank()]
        if unranked:
            raise ValueError(f"{', '.join(unranked)} cannot fill a quantized tier (they do not rank tokens)")
    cells = []
    for p in policies:
        if not policy_class(p).evicts:
            instance = get_policy(p)
            cells.append(Cell(p, None, None, {}, instance.config(), False, False))
    for budget in budgets:
        for p in evicting:
            instance = get_policy(p, **opts[p])
            reserved = instance.sinks + instance.window
            if reserved > budget + quantized:
                room = f"the budget {budget}" + (f" + {quantized} quantized" if quantized else "")
                raise ValueError(
                    f"{p}: sinks ({instance.sinks}) + window ({instance.window}) = {reserved} protected tokens "
                    f"exceed {room}"
                )
            stochastic = bool(type(instance).stochastic)
            cells.append(Cell(p, budget, buffer, dict(opts[p]), instance.config(), stochastic, True, quantized, bits))
    return cells


# ---------------------------------------------------------------------------------- the plan


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def parse_samples(samples: int | str | Mapping[str, int], datasets: Sequence[str]) -> dict[str, int]:
    """Samples per dataset from ``8``, ``"aime25=64,math500=8,gpqa=16"`` or ``"4,aime25=64"`` (a bare
    number is the default for the datasets not named; without one they get 1)."""
    default, named = 1, {}
    if isinstance(samples, Mapping):
        named = dict(samples)
    elif isinstance(samples, str):
        for item in (part.strip() for part in samples.split(",")):
            if not item:
                continue
            name, sep, value = item.rpartition("=")
            try:
                count = int(value)
            except ValueError:
                raise ValueError(f"samples: expected N or DATASET=N, got {item!r}") from None
            if sep:
                named[name.strip()] = count
            else:
                default = count
    else:
        default = samples
    _check_int("samples", default, 1)
    unknown = sorted(set(named) - set(datasets))
    if unknown:
        raise ValueError(f"samples given for {', '.join(unknown)}, which is not in --dataset ({', '.join(datasets)})")
    for name, count in named.items():
        _check_int(f"samples for {name}", count, 1)
    return {name: named.get(name, default) for name in datasets}


def _dataset_file(name: str) -> Path:
    """The file a dataset name reads: the bundled file, or the path itself."""
    from reasonkv.eval.datasets import dataset_path

    try:
        return dataset_path(name)
    except ValueError:
        return Path(name)


@dataclass
class GridPlan:
    """A validated grid, its units and their split across shards: everything but the model."""

    datasets: list[tuple[str, list[Problem]]]
    limits: dict[str, int | None]
    cells: list[Cell]
    samples: dict[str, int]  # per dataset (deterministic cells run 1 at temperature 0)
    temperature: float
    max_new_tokens: int
    fidelity: bool
    fidelity_tokens: int
    shard: Shard
    units: list[Unit]
    owner: dict[Unit, int]

    def samples_for(self, dataset: str, index: int) -> int:
        cell = self.cells[index]
        return self.samples[dataset] if (self.temperature > 0 or cell.stochastic) else 1

    def mine(self) -> set[Unit]:
        return {u for u in self.units if self.owner[u] == self.shard.index}

    def dataset_files(self) -> list[Path]:
        return [_dataset_file(name) for name, _ in self.datasets]

    def summary(self) -> str:
        """Units, the most tokens they may generate, and each shard's share of the expected cost."""
        from reasonkv.eval.units import _cost

        generations = [u for u in self.units if u.kind == "generation"]
        lines = [
            f"{len(generations)} generation units (at most {len(generations) * self.max_new_tokens:,} new tokens, "
            f"every one running to {self.max_new_tokens}) and {len(self.units) - len(generations)} fidelity replays"
        ]
        for name, problems in self.datasets:
            count = sum(1 for u in generations if u.dataset == name)
            lines.append(f"  {name}: {len(problems)} problems, {count} generation units")
        if self.shard.count > 1:
            cost = [0.0] * self.shard.count
            units = [0] * self.shard.count
            for unit in self.units:
                cost[self.owner[unit]] += _cost(unit, self.cells, self.max_new_tokens, self.fidelity_tokens)
                units[self.owner[unit]] += 1
            total = sum(cost) or 1.0
            for rank in range(self.shard.count):
                share = f"{cost[rank] / total:.1%}"
                lines.append(f"  shard {rank}/{self.shard.count}: {units[rank]} units, {share} of the expected cost")
        return "\n".join(lines)


def plan_grid(
    *,
    dataset: str | Sequence[str],
    policies: str | Sequence[str] = ("full", "streaming"),
    budgets: Sequence[int] = (256,),
    buffer: int = 128,
    limit: int | None = None,
    samples: int | str | Mapping[str, int] = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    options: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
    fidelity: bool | None = None,
    fidelity_tokens: int | None = None,
    max_chunk: int | None = None,
    shard: Shard | str | tuple[int, int] | None = None,
    quantized: int = 0,
    bits: int | None = None,
    generation: bool = True,
) -> GridPlan:
    """Validate a grid and split its units across shards (see :func:`run_grid` for the arguments)."""
    specs = parse_dataset_spec(dataset, limit)
    datasets = [(name, load_dataset(name, limit=n)) for name, n in specs]
    per_dataset = parse_samples(samples, [name for name, _ in datasets])
    _check_int("batch_size", batch_size, 1)
    _check_int("max_new_tokens", max_new_tokens, 1)
    _check_int("top_k", top_k, 0)
    _check_int("seed", seed, 0)
    if fidelity_tokens is not None:
        _check_int("fidelity_tokens", fidelity_tokens, 1)
    if max_chunk is not None:
        _check_int("max_chunk", max_chunk, 1)
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    cells = make_cells(_split_names(policies), list(budgets), buffer, options, quantized, bits)
    if all(len(problems) == 0 for _, problems in datasets):
        raise ValueError("the datasets hold no problems")
    if not isinstance(generation, bool):
        raise ValueError(f"generation must be True or False, got {generation!r}")
    if not generation:
        if fidelity is False:
            raise ValueError("fidelity-only (generation=False) with fidelity off would measure nothing")
        fidelity = True
    if fidelity is None:
        fidelity = any(p.solution for _, problems in datasets for p in problems)
    shard = Shard.resolve(shard)
    plan = GridPlan(
        datasets=datasets,
        limits=dict(specs),
        cells=cells,
        samples=per_dataset,
        temperature=float(temperature),
        max_new_tokens=max_new_tokens,
        fidelity=bool(fidelity),
        fidelity_tokens=fidelity_tokens or max_new_tokens,
        shard=shard,
        units=[],
        owner={},
    )
    counts = {(name, i): plan.samples_for(name, i) for name, _ in datasets for i in range(len(cells))}
    plan.units = grid_units(datasets, cells, counts, plan.fidelity, generation)
    plan.owner = assign(
        plan.units, cells, shard.count, max_new_tokens=max_new_tokens, fidelity_tokens=plan.fidelity_tokens
    )
    return plan


# ---------------------------------------------------------------------------------- results


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
        for name, (correct, total) in self.accuracy.items():
            rate = f"{correct / total:.3f}" if total else "-"
            lines.append(f"  {name:<40} accuracy {correct}/{total} = {rate}")
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


def _dtype_name(model) -> str:
    import torch

    dtype = next(model.parameters()).dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _model_name(model) -> str:
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return str(name) or type(model).__name__


def _prompt_format(tokenizer, thinking: bool | None) -> str:
    base = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    return base if thinking is None else f"{base}:thinking={'on' if thinking else 'off'}"


def _manifest(ctx, plan: GridPlan, model, top_p: float, top_k: int, batch_size: int, command) -> dict[str, Any]:
    from reasonkv.eval.manifest import build_manifest, file_sha256, tokenizer_sha256, weights_sha256

    config = getattr(model, "config", None)
    setup = {
        "model": ctx.model_name,
        "model_revision": getattr(config, "_commit_hash", None),
        "weights_sha256": weights_sha256(model),
        "tokenizer_sha256": tokenizer_sha256(ctx.tokenizer),
        "dtype": ctx.dtype,
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "prompt_format": ctx.prompt_format,
        "max_new_tokens": plan.max_new_tokens,
        "temperature": plan.temperature,
        "top_p": float(top_p),
        "top_k": top_k,
        "seed": ctx.base_seed,
    }
    datasets = [
        {
            "name": name,
            "file": str(path),
            "sha256": file_sha256(path),
            "limit": plan.limits[name],
            "problems": len(problems),
            "samples": plan.samples[name],
        }
        for (name, problems), path in zip(plan.datasets, plan.dataset_files(), strict=True)
    ]
    policies = [{"label": c.label, "budget": c.budget, "buffer": c.buffer, "config": c.config} for c in plan.cells]
    return build_manifest(
        setup=setup,
        device=ctx.device,
        datasets=datasets,
        policies=policies,
        fidelity=plan.fidelity,
        fidelity_tokens=plan.fidelity_tokens,
        batch_size=batch_size,
        command=command,
        world_size=plan.shard.count,
    )


# ---------------------------------------------------------------------------------- the grid


def run_grid(
    model,
    tokenizer=None,
    *,
    dataset: str | Sequence[str],
    out: str | os.PathLike[str],
    policies: str | Sequence[str] = ("full", "streaming"),
    budgets: Sequence[int] = (256,),
    buffer: int = 128,
    limit: int | None = None,
    samples: int | str | Mapping[str, int] = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    options: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
    fidelity: bool | None = None,
    fidelity_tokens: int | None = None,
    thinking: bool | None = None,
    model_name: str | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    progress: bool = True,
    on_record: Callable[[dict], None] | None = None,
    max_chunk: int | None = None,
    shard: Shard | str | tuple[int, int] | None = None,
    retry_errors: bool = False,
    command: Sequence[str] | None = None,
    quantized: int = 0,
    bits: int | None = None,
    generation: bool = True,
) -> GridResult:
    """Run (or resume) an evaluation grid, or this process's shard of it, and append its records.

    Parameters
    ----------
    model, tokenizer
        A loaded model and its tokenizer, or a model name for :func:`reasonkv.load_model` (then
        ``tokenizer`` is ignored and ``dtype``/``device``/``attn_implementation`` are used).
    dataset
        A bundled benchmark (``gsm8k``, ``math500``, ``aime24``, ``aime25``, ``hmmt25``, ``gpqa``) or a
        JSONL path; several comma-separated, each optionally with its own limit (``gsm8k:40``).
    out
        The JSONL results file of the run (a shard writes ``<out stem>.shard-I-of-N<suffix>`` next to it;
        see :mod:`reasonkv.eval.shards`). Records already in the run's files are skipped.
    policies, budgets, buffer
        The grid. ``full`` runs once per problem whatever the budgets.
    limit
        First ``limit`` problems of each dataset (``None``: all).
    samples
        Samples per problem: a number, or per dataset (``"aime25=64,math500=8"``, see
        :func:`parse_samples`). Deterministic policies at temperature 0 run one.
    temperature, top_p, top_k, max_new_tokens
        Sampling settings for :func:`reasonkv.generate`.
    batch_size
        Prompts decoded together (same policy and budget).
    seed
        Base seed; see :func:`sample_seed`.
    options
        Policy hyper-parameters: ``["key=value", "policy.key=value"]`` strings (see
        :func:`policy_options`) or ``{policy: {key: value}}``.
    fidelity
        Also write fidelity records (``None``: on when some problem has a reference solution).
    fidelity_tokens
        Length of the full-cache greedy trace replayed for fidelity (default ``max_new_tokens``).
    thinking
        Passed to :func:`reasonkv.eval.build_prompt` (``enable_thinking`` of Qwen3-style templates).
    model_name
        Recorded model name (default: the name given, or the model's ``name_or_path``).
    progress
        Show progress bars with ETA and the running accuracy of the current cell.
    on_record
        Called with each record right after it is written.
    max_chunk
        Most tokens per forward pass in fidelity replays (default 64).
    shard
        This process's share: ``"I/N"`` or ``(I, N)``; default: from a ``torch.distributed`` launcher
        (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), else the whole grid.
    retry_errors
        Run again the units whose record is an error.
    command
        The command line, for the manifest.
    quantized, bits
        A quantized tier for every evicting cell: ``quantized`` tokens per head at ``bits`` (4 or 8).
    generation
        False: no generation records for the evicting cells, only fidelity records (``full``, if
        listed, still generates: its greedy outputs are the traces the fidelity replays).

    Returns
    -------
    GridResult
    """
    from reasonkv.eval.manifest import check_compatible
    from reasonkv.eval.phases import Context, Ledger, run_fidelity, run_generation

    # Validate everything that does not need the model before loading it.
    plan = plan_grid(
        dataset=dataset, policies=policies, budgets=budgets, buffer=buffer, limit=limit, samples=samples,
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, batch_size=batch_size,
        seed=seed, options=options, fidelity=fidelity, fidelity_tokens=fidelity_tokens, max_chunk=max_chunk,
        shard=shard, quantized=quantized, bits=bits, generation=generation,
    )  # fmt: skip
    out = Path(out)
    target = writer_path(out, plan.shard)
    refuse_inputs([out, target], plan.dataset_files())
    for path in _run_files(out):
        scan_results(path, first_only=True)  # a file that is not ours is refused before the model loads

    if isinstance(model, (str, os.PathLike)):
        from reasonkv.models import load_model

        model_name = model_name or os.fspath(model)
        device = plan.shard.device(device)
        print(f"loading {model_name} ({dtype}, {device}, {attn_implementation}) ...", file=sys.stderr, flush=True)
        model, tokenizer = load_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation)
    if tokenizer is None:
        raise ValueError("the eval needs a tokenizer (shape: models have none)")

    ctx = Context(
        model=model,
        tokenizer=tokenizer,
        model_name=model_name or _model_name(model),
        dtype=_dtype_name(model),
        device=str(next(model.parameters()).device),
        prompt_format=_prompt_format(tokenizer, thinking),
        thinking=thinking,
        base_seed=seed,
        samples=plan.samples,
        temperature=plan.temperature,
        top_p=float(top_p),
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        fidelity_tokens=plan.fidelity_tokens,
        max_chunk=max_chunk,
        progress=progress,
        on_record=on_record,
        label=f"[{plan.shard.label}] " if plan.shard.count > 1 else "",
        ledger=Ledger(retry_errors=retry_errors),
    )
    manifest = _manifest(ctx, plan, model, top_p, top_k, batch_size, command)
    ctx.run_id = manifest["id"]
    warned: list[str] = []

    def compatible(path: Path, manifests: list[dict]) -> None:
        differences = check_compatible(path, manifests, manifest)
        if differences and not warned:
            warned.append(path.name)
            print(
                f"warning: {path} was written in another environment ({'; '.join(differences)}); "
                "this run's manifest is added",
                file=sys.stderr,
            )

    result = GridResult(path=out, written_to=target, shard=plan.shard)
    mine = plan.mine()
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = lock_for_writing(out, plan.shard)
    try:
        for path in _run_files(out):
            if path != target:
                manifests = scan_results(path, ctx.ledger.note)
                compatible(path, manifests)
        ctx.results = ResultsFile(
            target, manifest, visit=ctx.ledger.note, check=lambda ms: compatible(target, ms), lock=False
        )
        with ctx.results:
            for name, problems in plan.datasets:
                run_generation(ctx, name, problems, plan.cells, mine)
                if plan.fidelity:
                    run_fidelity(ctx, name, problems, plan.cells, mine)
        ledger = ctx.ledger if plan.shard.count == 1 else None  # a single process knows the whole run
    finally:
        lock.release()
    result.generated, result.fidelity = ctx.counts["generation"], ctx.counts["fidelity"]
    result.errors, result.skipped = ctx.counts["error"], ctx.counts["skipped"]
    result.accuracy = {name: tuple(tally) for name, tally in ctx.tally.items()}
    _finish(result, plan, ctx, ledger)
    return result


def _run_files(out: Path) -> list[Path]:
    """``out`` (when it exists) and its shard files: every file of the run."""
    return [p for p in [out] if p.exists()] + [p for p, _ in shard_files(out)]


def _finish(result: GridResult, plan: GridPlan, ctx, ledger) -> None:
    """Whether the grid is complete; if so, merge the shard files into ``--out``."""
    from reasonkv.eval.phases import Ledger

    if ledger is None:  # other shards wrote too: read what the run's files hold now
        ledger = Ledger()
        for path in _run_files(result.path):
            scan_results(path, ledger.note)
    problems = {(name, p.id): p for name, problems in plan.datasets for p in problems}
    missing = failed = 0
    for unit in plan.units:
        problem, cell = problems[(unit.dataset, unit.problem)], plan.cells[unit.cell]
        if unit.kind == "generation":
            key = unit_key(ctx.generation_key(unit.dataset, problem, cell, unit.sample))
        else:
            key = unit_key(ctx.fidelity_key(unit.dataset, problem, cell))
        missing += not ledger.recorded(key)
        failed += ledger.failed(key)
    result.complete, result.missing, result.failed = missing == 0, missing, failed
    if result.complete and shard_files(result.path):
        result.merged = merge_shards(result.path)
