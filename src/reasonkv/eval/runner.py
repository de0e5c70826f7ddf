"""The evaluation grid: datasets x policies x budgets x samples, written record by record, resumable.

:func:`run_grid` decodes every (problem, policy, budget, sample) with :func:`reasonkv.generate`,
grades it and appends one ``"kind": "generation"`` record to a JSONL file as soon as its batch
finishes; then, with ``fidelity`` on, one ``"kind": "fidelity"`` record per (problem, evicting
policy, budget) (see :mod:`reasonkv.eval.fidelity`). Rerunning the same command skips every
record already in the file (:func:`reasonkv.eval.records.record_key` says which fields identify
one), so a killed run resumes where it stopped and loses nothing.

Work order: problems are taken in groups of about ``batch_size``; for each group every cell
(policy, budget) runs in turn, the group's (problem, sample) pairs decoded together in batches of
``batch_size``. A partial run therefore covers every cell on its first problems, and batching is
safe because ``reasonkv.generate`` gives each prompt the same tokens in a batch as alone.

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
    policy: ``observe``, ``score``, ``gather``), ``reasonkv_version``, ``time``.

Fidelity records (``"kind": "fidelity"``), one per (problem, evicting policy, budget)
    The identity fields above (no sampling settings; ``fidelity_tokens`` instead), then
    ``trace_tokens``, ``trace_source`` (``generation``: the greedy full-cache record of this file was
    reused; ``regenerated``), ``top1_agreement``, ``top1_full_replay``, ``kl_mean``, ``kl_max``,
    ``evictions``, ``chunked``, and for problems with a reference solution ``reference_tokens``,
    ``answer_tokens``, ``answer_logprob_full``, ``answer_logprob_evicting``, ``answer_logprob_delta``
    (evicting minus full, summed over the answer tokens), ``answer_logprob_delta_mean`` (per token),
    ``answer_evictions`` (all ``null`` without a reference); ``seconds`` (per record), ``time``.
    The eviction seed is that of sample 0. ``full`` gets no fidelity records (it is the reference).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from reasonkv.eval.collapse import collapse_flags
from reasonkv.eval.datasets import Problem, load_dataset
from reasonkv.eval.grading import grade
from reasonkv.eval.prompts import build_prompt
from reasonkv.eval.records import ResultsFile, record_key

__all__ = [
    "Cell",
    "GridResult",
    "make_cells",
    "parse_dataset_spec",
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


# ---------------------------------------------------------------------------------- results


@dataclass
class GridResult:
    """What :func:`run_grid` did."""

    path: Path
    generated: int = 0  # generation records written by this run
    fidelity: int = 0  # fidelity records written by this run
    skipped: int = 0  # records already in the file
    accuracy: dict[str, tuple[int, int]] = field(default_factory=dict)  # "dataset cell" -> (correct, total)

    def summary(self) -> str:
        lines = [
            f"{self.path}: {self.generated} generation and {self.fidelity} fidelity records written, "
            f"{self.skipped} already there"
        ]
        for name, (correct, total) in self.accuracy.items():
            rate = f"{correct / total:.3f}" if total else "-"
            lines.append(f"  {name:<40} accuracy {correct}/{total} = {rate}")
        return "\n".join(lines)


def _dtype_name(model) -> str:
    import torch

    dtype = next(model.parameters()).dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _model_name(model) -> str:
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return str(name) or type(model).__name__


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt (no second BOS when the chat template already holds one)."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    ids = list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
    if not ids:
        raise ValueError("empty prompt")
    return ids


def _prompt_format(tokenizer, thinking: bool | None) -> str:
    base = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    return base if thinking is None else f"{base}:thinking={'on' if thinking else 'off'}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _chunks(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    # Redrawn often on a terminal; every 30 s in a log file.
    interval = 0.5 if sys.stderr.isatty() else 30.0
    return tqdm(
        total=total, desc=desc, unit="rec", dynamic_ncols=True, mininterval=interval, disable=not enabled or total == 0
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
    samples: int = 1,
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
    quantized: int = 0,
    bits: int | None = None,
    generation: bool = True,
) -> GridResult:
    """Run (or resume) an evaluation grid and append its records to ``out``.

    Parameters
    ----------
    model, tokenizer
        A loaded model and its tokenizer, or a model name for :func:`reasonkv.load_model` (then
        ``tokenizer`` is ignored and ``dtype``/``device``/``attn_implementation`` are used).
    dataset
        A bundled benchmark (``gsm8k``, ``math500``, ``aime24``, ``aime25``, ``hmmt25``, ``gpqa``) or a
        JSONL path; several comma-separated, each optionally with its own limit (``gsm8k:40``).
    out
        The JSONL results file (appended to; existing records are skipped).
    policies, budgets, buffer
        The grid. ``full`` runs once per problem whatever the budgets.
    limit
        First ``limit`` problems of each dataset (``None``: all).
    samples
        Samples per problem (deterministic policies at temperature 0 run one).
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
    quantized, bits
        A quantized tier for every evicting cell: ``quantized`` tokens per head at ``bits`` (4 or 8).
    generation
        False: no generation records for the evicting cells, only fidelity records (``full``, if
        listed, still generates: its greedy outputs are the traces the fidelity replays).

    Returns
    -------
    GridResult
    """
    # Validate everything that does not need the model before loading it.
    specs = parse_dataset_spec(dataset, limit)
    datasets = [(name, load_dataset(name, limit=n)) for name, n in specs]
    _check_int("samples", samples, 1)
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
    if not generation:
        if fidelity is False:
            raise ValueError("fidelity-only (generation=False) with fidelity off would measure nothing")
        fidelity = True
    if fidelity is None:
        fidelity = any(p.solution for _, problems in datasets for p in problems)

    if isinstance(model, (str, os.PathLike)):
        from reasonkv.models import load_model

        model_name = model_name or os.fspath(model)
        print(f"loading {model_name} ({dtype}, {device}, {attn_implementation}) ...", file=sys.stderr, flush=True)
        model, tokenizer = load_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation)
    if tokenizer is None:
        raise ValueError("the eval needs a tokenizer (shape: models have none)")

    context = _Context(
        model=model,
        tokenizer=tokenizer,
        model_name=model_name or _model_name(model),
        dtype=_dtype_name(model),
        device=str(next(model.parameters()).device),
        prompt_format=_prompt_format(tokenizer, thinking),
        thinking=thinking,
        base_seed=seed,
        samples=samples,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        fidelity_tokens=fidelity_tokens or max_new_tokens,
        max_chunk=max_chunk,
        progress=progress,
        on_record=on_record,
    )
    result = GridResult(path=Path(out))
    with ResultsFile(out) as results:
        for name, problems in datasets:
            generating = cells if generation else [c for c in cells if not c.evicts]
            if generating:
                _run_generation(context, results, result, name, problems, generating)
            if fidelity:
                _run_fidelity(context, results, result, name, problems, [c for c in cells if c.evicts])
    return result


@dataclass
class _Context:
    model: Any
    tokenizer: Any
    model_name: str
    dtype: str
    device: str
    prompt_format: str
    thinking: bool | None
    base_seed: int
    samples: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    batch_size: int
    fidelity_tokens: int
    max_chunk: int | None
    progress: bool
    on_record: Callable[[dict], None] | None
    _prompts: dict = field(default_factory=dict)
    _tiers: dict = field(default_factory=dict)

    def samples_for(self, cell: Cell) -> int:
        return self.samples if (self.temperature > 0 or cell.stochastic) else 1

    def prompt_ids(self, problem: Problem) -> list[int]:
        key = (problem.id, problem.kind, problem.problem)  # ids may repeat across user files
        if key not in self._prompts:
            text = build_prompt(self.tokenizer, problem, thinking=self.thinking)
            self._prompts[key] = encode_prompt(self.tokenizer, text)
        return self._prompts[key]

    def base(self, kind: str, dataset: str, problem: Problem, cell: Cell) -> dict[str, Any]:
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

    def tier(self, cell: Cell) -> dict[str, int] | None:
        """The cell's quantized tier as recorded (with the group size it gets on this model), or None."""
        if not cell.quantized:
            return None
        if cell not in self._tiers:
            from reasonkv.hf import model_info
            from reasonkv.quantize import default_group_size

            group_size = default_group_size(model_info(self.model).head_dim)
            self._tiers[cell] = {**cell.tier, "group_size": group_size}
        return self._tiers[cell]

    def equivalent_budget(self, cell: Cell) -> float | None:
        """The full-precision budget with the cell's nominal K/V bytes (its budget without a tier)."""
        if not cell.quantized:
            return cell.budget
        from reasonkv.hf import model_info
        from reasonkv.quantize import QuantFormat
        from reasonkv.tiers import equivalent_budget

        tier = self.tier(cell)
        size = next(self.model.parameters()).element_size()
        fmt = QuantFormat(tier["bits"], tier["group_size"])
        return round(equivalent_budget(cell.budget, cell.quantized, fmt, model_info(self.model).head_dim, size), 2)

    def generation_key(self, dataset: str, problem: Problem, cell: Cell, sample: int) -> dict[str, Any]:
        return {
            **self.base("generation", dataset, problem, cell),
            "sample": sample,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }

    def emit(self, results: ResultsFile, record: dict) -> None:
        results.append(record)
        if self.on_record is not None:
            self.on_record(record)


def _peak_row_tokens(prompt_tokens: int, output_tokens: int, evictions: int, cell: Cell) -> int:
    """Most tokens the row's cache held at once (exact for this cache's schedule).

    The last sampled token is never fed back, so a row stores ``prompt + output - 1`` tokens in
    all; once evicted it peaked at ``K + B`` (or at the whole prompt, if that was longer).
    """
    stored = prompt_tokens + max(output_tokens - 1, 0)
    if evictions == 0 or cell.budget is None:
        return stored
    return max(prompt_tokens, cell.budget + cell.buffer + cell.quantized)


def _run_generation(ctx: _Context, results: ResultsFile, result: GridResult, dataset: str, problems, cells) -> None:
    import reasonkv

    by_key = {record_key(r): r for r in results.records if r.get("kind") == "generation"}
    pending: list[tuple[Cell, Problem, int]] = []
    tally: dict[Cell, list[int]] = {cell: [0, 0] for cell in cells}
    for cell in cells:
        for problem in problems:
            for s in range(ctx.samples_for(cell)):
                done = by_key.get(record_key(ctx.generation_key(dataset, problem, cell, s)))
                if done is None:
                    pending.append((cell, problem, s))
                else:
                    result.skipped += 1
                    tally[cell][0] += bool(done.get("correct"))
                    tally[cell][1] += 1
    todo = {(cell, problem.id, s) for cell, problem, s in pending}
    most_samples = max(ctx.samples_for(c) for c in cells)
    group_size = max(1, ctx.batch_size // most_samples)
    bar = _progress(len(pending), f"{dataset} generate", ctx.progress)
    try:
        for group in _chunks(problems, group_size):
            for cell in cells:
                items = [(p, s) for p in group for s in range(ctx.samples_for(cell)) if (cell, p.id, s) in todo]
                for batch in _chunks(items, ctx.batch_size):
                    bar.set_postfix_str(_running(dataset, cell, tally[cell]), refresh=False)
                    for record in _generate_batch(ctx, reasonkv, dataset, cell, batch):
                        ctx.emit(results, record)
                        result.generated += 1
                        tally[cell][0] += bool(record["correct"])
                        tally[cell][1] += 1
                        bar.set_postfix_str(_running(dataset, cell, tally[cell]), refresh=False)
                        bar.update(1)
    finally:
        bar.close()
    for cell in cells:
        result.accuracy[f"{dataset} {cell.name}"] = tuple(tally[cell])


def _running(dataset: str, cell: Cell, tally: list[int]) -> str:
    correct, total = tally
    acc = f"{correct / total:.2f} ({correct}/{total})" if total else "-"
    return f"{cell.name}: acc {acc}"


def _generate_batch(ctx: _Context, reasonkv, dataset: str, cell: Cell, batch) -> list[dict]:
    seeds = [sample_seed(ctx.base_seed, p.id, s) for p, s in batch]
    outputs = reasonkv.generate(
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
        seed=seeds,
        **cell.tier,
    )
    records = []
    for (problem, s), seed, out in zip(batch, seeds, outputs, strict=True):
        stats = out.stats
        eos_hit = out.finish_reason == "eos"
        ids = out.token_ids[:-1] if eos_hit else out.token_ids
        verdict = grade(out.text, problem)
        flags = collapse_flags(out.text, ids, max_new_tokens=ctx.max_new_tokens, eos_hit=eos_hit, kind=problem.kind)
        seconds = stats["prefill_seconds"] + stats["decode_seconds"]
        record = ctx.generation_key(dataset, problem, cell, s)
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
            seconds=seconds,
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
            time=_now(),
        )
        records.append(record)
    return records


# ---------------------------------------------------------------------------------- fidelity


def _fidelity_key(ctx: _Context, dataset: str, problem: Problem, cell: Cell) -> dict[str, Any]:
    return {**ctx.base("fidelity", dataset, problem, cell), "fidelity_tokens": ctx.fidelity_tokens}


def _full_trace_from_records(ctx: _Context, results: ResultsFile, dataset: str) -> dict[str, list[int]]:
    """Greedy full-cache outputs already in the file, cut to ``fidelity_tokens``."""
    traces: dict[str, list[int]] = {}
    for r in results.records:
        if (
            r.get("kind") == "generation"
            and r.get("policy") == "full"
            and r.get("temperature") == 0
            and r.get("sample") == 0
            and r.get("model") == ctx.model_name
            and r.get("dtype") == ctx.dtype
            and r.get("dataset") == dataset
            and r.get("prompt_format") == ctx.prompt_format
            and isinstance(r.get("output_ids"), list)
            and r["output_ids"]
        ):
            ids = r["output_ids"]
            # A shorter greedy run is a prefix of a longer one only if it stopped on its own.
            if len(ids) >= ctx.fidelity_tokens or r.get("finish_reason") != "length":
                traces[r["problem_id"]] = ids[: ctx.fidelity_tokens]
    return traces


def _run_fidelity(ctx: _Context, results: ResultsFile, result: GridResult, dataset: str, problems, cells) -> None:
    import reasonkv
    from reasonkv.eval import fidelity as fid

    pending: list[tuple[Cell, Problem]] = []
    for cell in cells:
        for problem in problems:
            if results.is_done(_fidelity_key(ctx, dataset, problem, cell)):
                result.skipped += 1
            else:
                pending.append((cell, problem))
    if not pending:
        return
    needed = {p.id: p for _, p in pending}
    traces = _full_trace_from_records(ctx, results, dataset)
    sources = {pid: "generation" for pid in traces}
    missing = [p for p in problems if p.id in needed and p.id not in traces]
    bar = _progress(len(missing), f"{dataset} full-cache traces", ctx.progress)
    try:
        for batch in _chunks(missing, ctx.batch_size):
            outs = reasonkv.generate(
                ctx.model,
                ctx.tokenizer,
                [ctx.prompt_ids(p) for p in batch],
                policy="full",
                max_new_tokens=ctx.fidelity_tokens,
            )
            for p, out in zip(batch, outs, strict=True):
                traces[p.id] = list(out.token_ids)
                sources[p.id] = "regenerated"
                bar.update(1)
    finally:
        bar.close()
    references = {pid: fid.reference_continuation(ctx.tokenizer, p) for pid, p in needed.items()}
    pad_id = fid._pad_id(ctx.tokenizer)
    chunk = ctx.max_chunk or fid.DEFAULT_MAX_CHUNK
    bar = _progress(len(pending), f"{dataset} fidelity", ctx.progress)
    try:
        for cell in cells:
            cell_problems = [p for c, p in pending if c == cell]
            cell_problems.sort(key=lambda p: len(ctx.prompt_ids(p)) + len(traces[p.id]))
            for batch in _chunks(cell_problems, ctx.batch_size):
                bar.set_postfix_str(cell.name, refresh=False)
                for record in _fidelity_batch(ctx, dataset, cell, batch, traces, sources, references, pad_id, chunk):
                    ctx.emit(results, record)
                    result.fidelity += 1
                    bar.update(1)
    finally:
        bar.close()


def _fidelity_batch(ctx, dataset, cell, batch, traces, sources, references, pad_id, chunk) -> list[dict]:
    from reasonkv.eval import fidelity as fid

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
        record = _fidelity_key(ctx, dataset, problem, cell)
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
            time=_now(),
        )
        records.append(record)
    return records
