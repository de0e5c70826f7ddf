"""The evaluation grid's settings: one frozen :class:`GridSpec`, built once (by the command line or in Python).
Its cells are its distinct cache specs: ``full`` is one cell whatever the budgets.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from reasonkv.cache.allocation import Uniform, allocation_class, check_allocation
from reasonkv.cache.spec import DEFAULT_BUFFER, CacheSpec
from reasonkv.eval.livecodebench import parse_day
from reasonkv.generation.inputs import check_flags
from reasonkv.generation.sampling import Sampling
from reasonkv.policies import options_by_policy, policy_class
from reasonkv.sandbox import Sandbox
from reasonkv.sandbox.limits import check_memory, check_timeout
from reasonkv.suggest.integers import check_int, is_int

__all__ = ["Cell", "CodeSettings", "GridSpec", "make_cells", "parse_dataset_spec", "parse_samples", "policy_options"]


@dataclass(frozen=True)
class Cell:
    """One (policy, budget) of the grid: its cache spec and the options the user set (for its label)."""

    spec: CacheSpec
    options: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def policy(self) -> str:
        return self.spec.policy.name

    @property
    def budget(self) -> int | None:
        return self.spec.budget

    @property
    def buffer(self) -> int | None:
        """``B``, or None for the full cache (it never evicts)."""
        return self.spec.buffer if self.evicts else None

    @property
    def evicts(self) -> bool:
        """Whether the cell is measured against the full cache: its policy evicts, or selects what it reads."""
        return self.spec.evicts or self.spec.selects

    @property
    def stochastic(self) -> bool:
        return bool(type(self.spec.policy).stochastic)

    @property
    def quantized(self) -> int:
        return self.spec.quantized

    @property
    def bits(self) -> int | None:
        return self.spec.bits

    @property
    def allocation(self) -> str:
        """How the cell shares its budget among layers and kv-heads (``uniform``: ``K`` each)."""
        return self.spec.allocation

    @property
    def config(self) -> dict[str, Any]:
        """Every hyper-parameter of the policy."""
        return self.spec.policy.config()

    @property
    def label(self) -> str:
        """The policy name, with the options set by the user, the quantized tier and the allocation:
        ``epikv[variant=lag]``, ``snapkv+int4:199``, ``h2o~pyramid``."""
        label = self.policy
        if self.options:
            label += f"[{','.join(f'{k}={_fmt(v)}' for k, v in sorted(self.options.items()))}]"
        label += f"+int{self.bits}:{self.quantized}" if self.quantized else ""
        return label + self.spec.allocation_rule.tag

    @property
    def name(self) -> str:
        return self.label if self.budget is None else f"{self.label}@{self.budget}"


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "/".join(map(str, value))
    return str(value)


def _split_names(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else [v for item in value for v in str(item).split(",")]
    return [v.strip() for v in items if v.strip()]


def policy_options(policies: Sequence[str], pairs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Typed options per policy from ``KEY=VALUE`` / ``POLICY.KEY=VALUE`` strings."""
    return options_by_policy(policies, pairs)


def parse_dataset_spec(spec: str | Sequence[str], limit: int | None = None) -> list[tuple[str, int | None]]:
    """``"gsm8k:40,math500:20"`` -> ``[("gsm8k", 40), ("math500", 20)]``; no ``:N`` means ``limit``."""
    out: list[tuple[str, int | None]] = []
    for item in _split_names(str(spec) if isinstance(spec, os.PathLike) else spec):
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


def parse_samples(samples: int | str | Mapping[str, int], datasets: Sequence[str]) -> dict[str, int]:
    """Samples per dataset from ``8``, ``"aime25=64,math500=8,gpqa=16"`` or ``"4,aime25=64"`` (a bare
    number is the default for the datasets not named; without one they get 1)."""
    default, named = 1, {}
    if isinstance(samples, Mapping):
        named = dict(samples)
    elif isinstance(samples, str):
        for item in _split_names(samples):
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
    check_int("samples", default, 1)
    unknown = sorted(set(named) - set(datasets))
    if unknown:
        raise ValueError(f"samples given for {', '.join(unknown)}, which is not in --dataset ({', '.join(datasets)})")
    for name, count in named.items():
        check_int(f"samples for {name}", count, 1)
    return {name: named.get(name, default) for name in datasets}


def make_cells(
    policies: str | Sequence[str] = ("full", "streaming"),
    budgets: Sequence[int] = (256,),
    buffer: int = DEFAULT_BUFFER,
    options: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
    quantized: int = 0,
    bits: int | None = None,
    allocations: str | Sequence[str] = (Uniform.name,),
    budgets_file: str | None = None,
) -> list[Cell]:
    """The grid's cells: ``full`` once first, then every budget x evicting policy (x allocation, ``budgets_file``
    for ``calibrated``). Each cell's :class:`~reasonkv.cache.CacheSpec` checks that it fits its budget."""
    policies = _split_names(policies)
    if not policies:
        raise ValueError("no policy given")
    if len(set(policies)) != len(policies):
        raise ValueError(f"policy listed twice: {', '.join(policies)}")
    classes = {p: policy_class(p) for p in policies}  # an unknown name: ValueError listing the valid ones
    if isinstance(options, Mapping):
        chosen = {p: dict(options.get(p, {})) for p in policies}
    else:
        chosen = policy_options(policies, list(options or []))
    budgets = list(budgets)
    for b in budgets:
        if not is_int(b) or b <= 0:
            raise ValueError(f"budgets must be positive integers, got {b!r}")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"budget listed twice: {budgets}")
    evicting = [p for p in policies if classes[p].evicts or classes[p].selects]
    if evicting and not budgets:
        raise ValueError(f"policies {', '.join(evicting)} evict: give at least one budget")
    if quantized and not any(classes[p].evicts for p in policies):
        raise ValueError(
            f"a quantized tier (--quantized {quantized}) keeps what an evicting policy evicts, and "
            f"{', '.join(policies)} evict{'' if len(policies) > 1 else 's'} nothing: add an evicting policy to "
            "--policies, or drop --quantized"
        )
    allocations = _split_names(allocations)
    if not allocations or len(set(allocations)) != len(allocations):
        raise ValueError(f"allocations must be distinct names, got {allocations!r}")
    for allocation in allocations:  # a known name, with the budget file where it takes one
        check_allocation(allocation, budgets_file)
    takes_file = {a: "budgets_file" in allocation_class(a).settings for a in allocations}
    # The budget file goes to the cells that take one; a grid without any hands it to every cell, whose spec refuses it.
    any_file = any(takes_file.values())
    cells: dict[Cell, None] = {}
    for evicts in (False, True):  # the full cache first: its outputs are the fidelity references
        for budget in budgets or [None]:
            for p in (p for p in policies if (classes[p].evicts or classes[p].selects) == evicts):
                tier = dict(quantized=quantized, bits=bits) if classes[p].evicts else {}
                for allocation in allocations if classes[p].evicts else [Uniform.name]:
                    file = budgets_file if takes_file.get(allocation) or not any_file else None
                    spec = CacheSpec.build(
                        p, budget, buffer, **tier, allocation=allocation, budgets_file=file, **chosen[p]
                    )
                    cells.setdefault(Cell(spec, chosen[p]))
    return list(cells)


@dataclass(frozen=True)
class CodeSettings:
    """How a grid runs code answers (:mod:`reasonkv.sandbox`): the opt-in, each test run's seconds and MiB,
    test runs at once (None: one per CPU), the sandbox guarantees accepted as missing here, and the contest
    date window of the problems (``YYYY-MM-DD``, both days included)."""

    allow_execution: bool = False
    timeout: float = 6.0
    memory_mb: int = 1024
    workers: int | None = None
    allow_missing: tuple[str, ...] = ()
    after: str | None = None
    before: str | None = None

    @classmethod
    def build(cls, *, allow_missing: str | Sequence[str] = (), **settings: Any) -> CodeSettings:
        """Checked settings (``allow_missing`` may be comma-separated)."""
        code = cls(**settings)
        check_flags(allow_execution=code.allow_execution)
        timeout = check_timeout(code.timeout, "code timeout")
        check_memory(code.memory_mb, "code memory_mb")
        if code.workers is not None:
            check_int("code workers", code.workers, 1)
        missing = Sandbox(allow_missing=_split_names(allow_missing)).allow_missing  # known names, sorted
        first = parse_day(code.after, "--after") if code.after else None
        last = parse_day(code.before, "--before") if code.before else None
        if first and last and first > last:
            raise ValueError(f"--after {code.after} is later than --before {code.before}: the window holds no day")
        days = {"after": first.isoformat() if first else None, "before": last.isoformat() if last else None}
        return replace(code, timeout=float(timeout), allow_missing=missing, **days)


@dataclass(frozen=True)
class GridSpec:
    """An evaluation grid: datasets (``(name or path, limit)``) x cells (:func:`make_cells`) x samples per
    problem (per dataset), how to decode and what to measure; build one with :meth:`build`.

    ``fidelity`` None: on when a dataset has reference solutions (decided when the datasets load);
    ``generation`` False: fidelity records only for the evicting cells (``full`` still generates its traces);
    ``thinking``: ``enable_thinking`` of Qwen3-style chat templates (None: the template's default);
    ``max_chunk``: most tokens per forward pass of a fidelity replay; ``trace_problems``: problem ids whose
    generations keep their eviction trace. ``compile`` and ``batch_size`` change speed, not results, and
    are not part of the grid's identity; a cell that cannot be compiled is refused when the grid is built.
    """

    datasets: tuple[tuple[str, int | None], ...]
    cells: tuple[Cell, ...]
    samples: Mapping[str, int] = field(hash=False)
    sampling: Sampling = Sampling(512)
    seed: int = 0
    batch_size: int = 8
    fidelity: bool | None = None
    fidelity_tokens: int | None = None
    generation: bool = True
    thinking: bool | None = None
    max_chunk: int | None = None
    code: CodeSettings = field(default_factory=CodeSettings)
    trace_problems: frozenset[str] = frozenset()
    compile: bool = False

    @classmethod
    def build(
        cls,
        *,
        dataset: str | Sequence[str],
        limit: int | None = None,
        samples: int | str | Mapping[str, int] = 1,
        max_new_tokens: int = 512,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        code: CodeSettings | Mapping[str, Any] | None = None,
        trace_problems: str | Sequence[str] = (),
        **settings: Any,
    ) -> GridSpec:
        """A grid from loose settings, as the command line gives them or as Python values: ``dataset``
        comma-separated, each optionally ``NAME:LIMIT``; ``samples`` a count or ``"aime25=64,math500=8"``;
        ``code`` a :class:`CodeSettings` or its keywords; ``settings`` the grid's own fields (``seed``,
        ``batch_size``, ``fidelity``, ...) and the keywords of :func:`make_cells`."""
        datasets = tuple(parse_dataset_spec(dataset, limit))
        per_dataset = parse_samples(samples, [name for name, _ in datasets])
        own = {f.name: settings.pop(f.name, f.default) for f in fields(cls) if f.name in _OWN}
        check_int("batch_size", own["batch_size"], 1)
        check_int("seed", own["seed"], 0)
        for name in ("fidelity_tokens", "max_chunk"):
            if own[name] is not None:
                check_int(name, own[name], 1)
        check_flags(**{name: own[name] for name in ("generation", "fidelity", "compile") if own[name] is not None})
        if not own["generation"]:
            if own["fidelity"] is False:
                raise ValueError("fidelity-only (generation=False) with fidelity off would measure nothing")
            own["fidelity"] = True
        sampling = Sampling(max_new_tokens, temperature, top_p, top_k)  # checked before the cells
        cells = make_cells(**settings)
        if own["compile"]:
            for cell in cells:
                cell.spec.check_compile()
        return cls(
            datasets=datasets,
            cells=tuple(cells),
            samples=per_dataset,
            sampling=sampling,
            code=code if isinstance(code, CodeSettings) else CodeSettings.build(**(code or {})),
            trace_problems=_problem_ids(trace_problems),
            **own,
        )

    @property
    def replay_tokens(self) -> int:
        """Tokens of the full-cache traces that fidelity replays."""
        return self.fidelity_tokens or self.sampling.max_new_tokens

    def samples_for(self, dataset: str, cell: Cell) -> int:
        """Samples of each problem of ``dataset`` in ``cell``: one where the output cannot differ."""
        return self.samples[dataset] if (self.sampling.temperature > 0 or cell.stochastic) else 1


#: The fields of a grid that :meth:`GridSpec.build` takes as they are (after checking them).
_OWN = ("seed", "batch_size", "fidelity", "fidelity_tokens", "generation", "thinking", "max_chunk", "compile")


def _problem_ids(ids: str | Sequence[str]) -> frozenset[str]:
    """``"id1,id2"`` or a list of ids -> a set of non-empty ids."""
    parts = ids.split(",") if isinstance(ids, str) else list(ids)
    if not all(isinstance(part, str) for part in parts):
        raise ValueError(f"trace_problems takes problem ids (text), got {ids!r}")
    return frozenset(part.strip() for part in parts if part.strip())
