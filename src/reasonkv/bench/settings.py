"""``reasonkv bench``'s settings: one frozen object, every flag a typed field, checked once.

What the command line builds from its arguments and a Python caller builds directly; the plan and the run
read nothing else. Building one checks every value and every combination that needs no model and no policy
(a ``ValueError`` naming the flag, the bad value and what is allowed), before any folder is touched.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasonkv.bench.measure import WARMUP_STEPS
from reasonkv.bench.memory import parse_bytes
from reasonkv.bench.prefilled import ragged_shifts
from reasonkv.cache import DEFAULT_BUFFER
from reasonkv.cache.allocation import Allocation, Uniform, allocation_rule, check_allocation_settings
from reasonkv.cache.tiers import check_settings
from reasonkv.generation.compiled import compile_backend
from reasonkv.models import (
    DEFAULT_MODEL,
    SHAPE_PREFIX,
    resolve_attn_implementation,
    resolve_device,
    resolve_dtype,
    shape_config,
)
from reasonkv.runs.flags import flag_values, setting, spell
from reasonkv.suggest.integers import check_int, is_int

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_LENGTHS",
    "DEFAULT_ROUNDS",
    "EVICTION",
    "MAX_BATCH",
    "SWEEP",
    "TRANSFORMERS",
    "BenchSettings",
    "parse_int_list",
]

DEFAULT_DTYPE = "bf16"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
SWEEP, EVICTION, MAX_BATCH = "sweep", "eviction-cost", "max-batch"
TRANSFORMERS = "transformers"  # the sweep's reference entry: transformers' own cache, no reasonkv hook


def parse_int_list(value: str | Sequence[int], what: str, *, increasing: bool = False) -> tuple[int, ...]:
    """``"1024,2048"`` (or ``[1024, 2048]``) -> ``(1024, 2048)``: positive integers, strictly increasing if
    asked, else without repeats."""
    parts = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    if not isinstance(parts, Sequence) or not parts:
        raise ValueError(f"{what}: expected comma-separated positive integers, got {value!r}")
    values = []
    for part in parts:
        try:
            if not (is_int(part) or isinstance(part, str)):
                raise ValueError
            number = int(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not an integer (in {value!r})") from None
        if number <= 0:
            raise ValueError(f"{what}: {number} is not positive (in {value!r})")
        values.append(number)
    if increasing and any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{what} must be strictly increasing, got {value!r}")
    if not increasing and len(set(values)) != len(values):
        raise ValueError(f"{what}: repeated values in {value!r}")
    return tuple(values)


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    names = tuple(n.strip() for n in items if n.strip())
    if not names:
        raise ValueError("--policies: give policy names separated by commas, or 'all'")
    return names


DEFAULT_ROUNDS = 3  # the sweep's interleaved rounds: an odd count, so the median is one round's


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_int(name: str, value: Any, minimum: int, what: str) -> None:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{_flag(name)} must be {what}, got {value}")


# How the flags several commands share are shown here.
_MODEL = {"dtype": DEFAULT_DTYPE, "why": "speed is measured in the dtype models are served in", "shapes": True}
_ALLOCATION = {
    "what": "; length sweep: every evicting entry runs under it, and the report shows its K/V bytes per layer"
}


# The keywords a group's fields share.
_policy = functools.partial(setting, group="policies")
_sweep = functools.partial(setting, group="length sweep")
_count = functools.partial(_sweep, type=int, always=True)  # a count the reproducing command always spells out
_output = functools.partial(setting, group="output")
_cost = functools.partial(setting, group="eviction cost")
_max_batch = functools.partial(setting, group="max batch")


def _joined(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """Everything one ``reasonkv bench`` run is told: the fields are its flags, in their order, each with its
    help; the lists the command line takes as text (``--lengths 1024,2048``) may be given as sequences."""

    model: str = setting(DEFAULT_MODEL, group="model", shared="model", shared_with=_MODEL, always=True)
    dtype: str = setting(DEFAULT_DTYPE, group="model", shared="model", shared_with=_MODEL, always=True)
    device: str = setting("cpu", group="model", shared="model", shared_with=_MODEL, always=True)
    attn: str = setting("sdpa", group="model", shared="model", shared_with=_MODEL, always=True)
    threads: int | None = setting(
        None, group="model", type=int, help="CPU threads for torch (default: torch's own choice; recorded either way)"
    )
    policies: tuple[str, ...] = _policy(
        ("all",),
        always=True,
        help="comma-separated policy names, or 'all' (default: every registered policy); full and streaming "
        "always run as references",
    )
    option: tuple[str, ...] = _policy((), repeated=True, short="-o", shared="policy options")
    budget: int = _policy(512, type=int, always=True, help="K: tokens kept per head after an eviction (default 512)")
    buffer: int = _policy(DEFAULT_BUFFER, always=True, shared="buffer")
    seed: int = _policy(0, type=int, always=True, help="seeds the prompts and the policies (default 0)")
    quantized: int = _policy(
        0,
        type="non-negative",
        metavar="Q",
        help="also measure every requested evicting policy with Q tokens per head kept quantized, its "
        "full-precision budget lowered so that its nominal K/V bytes equal the plain policy's at --budget "
        "(length sweep; default 0: no such variants)",
    )
    bits: int | None = _policy(None, type=int, choices=(4, 8), help="code width of the quantized tier (default 8)")
    allocation: str = _policy(Uniform.name, shared="allocation", shared_with=_ALLOCATION)
    budgets_file: str | None = _policy(None, shared="allocation", shared_with=_ALLOCATION)
    adaptive_alpha: float | None = _policy(None, shared="allocation", shared_with=_ALLOCATION)
    padded_heads: bool = _policy(False, shared="allocation", shared_with=_ALLOCATION)
    lengths: tuple[int, ...] | None = _sweep(
        None,
        help=f"lengths to report, strictly increasing (default {_joined(DEFAULT_LENGTHS)}; "
        "the sweep runs when this is given or when neither --max-batch nor --eviction-cost is)",
    )
    reference_lengths: bool = _sweep(
        True,
        negated=True,
        help="measure the --lengths only, not also K, K + B/2 and 8 K (what the summary's overhead and flatness "
        "compare with; then they compare with the nearest lengths measured)",
    )
    rounds: int = _count(
        DEFAULT_ROUNDS,
        help="the sweep's entries of each batch size measured in this many interleaved rounds (A B C A B C ...), "
        f"each figure the median round's, the rounds' spread beside it (default {DEFAULT_ROUNDS})",
    )
    batch_sizes: tuple[int, ...] = _sweep((1,), always=True, help="comma-separated batch sizes (default 1)")
    prompt_length: int = _count(
        32, help="tokens of the fixed random prompt; prefills feed the rest as if generated (default 32)"
    )
    window: int | None = _sweep(
        None,
        type=int,
        help="decode steps per measurement window, ending at each length (default: the smallest multiple of "
        "--buffer >= 32, so every window holds whole eviction cycles; all decode steps with --prefill-to-length)",
    )
    prefill_to_length: bool = _sweep(
        False,
        help="reach each length L by a prefill of L - n - 2 tokens (the --prompt-length prompt, then the rest "
        "as if generated), decode 2 untimed steps, then time n = --decode-steps steps ending at L: the prefill "
        "builds the cache at length L; an evicting policy is evicted to K by it (once, or after each "
        "--prefill-chunk once due) and measured in its steady state",
    )
    transformers_cache: bool = _sweep(
        False,
        help="also measure transformers' own cache (the one model.generate builds, no reasonkv hook) as the "
        "entry 'transformers': full against it is what reasonkv's bookkeeping costs (needs --prefill-to-length)",
    )
    decode_steps: int = _count(256, help="n: decode steps timed with --prefill-to-length and --max-batch (default 256)")
    sync_timing: bool = _sweep(
        True,
        negated=True,
        help="on CUDA, do not synchronise around each timed phase: step times unperturbed, but the phase "
        "split then covers kernel launches only",
    )
    prefill_chunk: int = _count(
        0,
        help="most tokens per prefill forward, summed over the batch (default 0: one forward; an evicting "
        "policy evicts after each chunk once due)",
    )
    ragged: bool = _sweep(
        False,
        help="also measure every requested evicting policy as 'POLICY~ragged' at each batch size above 1: its "
        "rows prefilled to lengths B / batch apart, so that they evict at different steps (as prompts of "
        "different lengths do), beside the rows that evict together (needs --prefill-to-length)",
    )
    compile: bool | str = _sweep(
        False,
        optional_value=True,
        metavar="BACKEND",
        help="also measure every policy as 'POLICY~compiled', its decode steps run as one compiled fixed-shape "
        "graph each (torch.compile; BACKEND: inductor, the default, or another torch.compile backend), and "
        "with --prefill-to-length plain transformers eager and compiled (a StaticCache and torch.compile of "
        "its forward) as 'transformers' and 'transformers~compiled'; compiling is timed apart, never in tok/s",
    )
    eviction_cost: bool = _cost(False, help="time one eviction per policy (batch 1, K = --cached - --buffer)")
    cached: int | None = _cost(None, type=int, help="N: tokens cached at each eviction (K = N - B)")
    repeats: int = _cost(5, type=int, help="evictions timed per policy, after one warm-up (default 5)")
    max_batch: bool = _max_batch(False, help="largest batch per policy within --memory-limit")
    memory_limit: str | None = _max_batch(None, help="e.g. 24GiB, 48GB, 512MiB")
    length: int | None = _max_batch(None, type=int, help="L: sequence length the batch must fit")
    probe_batches: tuple[int, ...] = _max_batch(
        (1, 2), help="two batch sizes the memory overhead is measured at (default 1,2)"
    )
    probe_steps: int = _max_batch(4, type=int, help="decode steps of each probe (default 4)")
    max_measured_batch: int = _max_batch(256, type=int, help="largest batch whose throughput is measured (default 256)")
    out: Path = _output(type=Path, required=True, always=True, help="folder for results.jsonl, bench.json/md, PNGs")
    force: bool = _output(False, help="re-measure entries already in --out")
    progress: bool = _output(True, negated=True, in_command=False, help="no progress bars")
    plots: bool = _output(True, negated=True, in_command=False, help="no PNG plots (JSON and markdown only)")

    def __post_init__(self) -> None:
        self._normalise()
        self._check_model()
        self._check_sizes()
        if self.eviction_cost:
            self._check_eviction_cost()
        if self.transformers_cache and not (self.prefill_to_length and self.runs_sweep):
            raise ValueError(
                "--transformers-cache needs the length sweep with --prefill-to-length (the decode sweep runs "
                "reasonkv.generate, which always decodes through an EvictingCache)"
            )
        if self.runs_sweep:
            self._check_sweep()
        if self.ragged:
            self._check_ragged()
        if self.compile is not False:
            self._check_compile()
        if self.max_batch:
            self._check_max_batch()
        self._check_allocation()

    def _normalise(self) -> None:
        """Text and sequences as the typed values (the command line hands over lists as text)."""
        for name in ("dtype", "device", "attn"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{_flag(name)} must be a name (a string), got {getattr(self, name)!r}")
        for name in (f.name for f in dataclasses.fields(self) if f.type == "bool"):  # the switches
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_int("--seed", self.seed)
        lists = {
            "batch_sizes": parse_int_list(self.batch_sizes, "--batch-sizes"),
            "probe_batches": parse_int_list(self.probe_batches, "--probe-batches"),
        }
        if self.lengths is not None:
            lists["lengths"] = parse_int_list(self.lengths, "--lengths", increasing=True)
        option = (self.option,) if isinstance(self.option, str) else tuple(self.option)
        paths = {"model": os.fspath(self.model), "out": Path(self.out)}
        if self.budgets_file is not None:
            paths["budgets_file"] = os.fspath(self.budgets_file)
        for name, value in {**lists, **paths, "policies": _names(self.policies), "option": option}.items():
            object.__setattr__(self, name, value)

    def _check_model(self) -> None:
        dtype = resolve_dtype(self.dtype)
        resolve_attn_implementation(self.attn, dtype, resolve_device(self.device))
        if self.model.startswith(SHAPE_PREFIX):
            shape_config(self.model[len(SHAPE_PREFIX) :])  # unknown shapes fail here, listing the known ones

    def _check_sizes(self) -> None:
        _check_int("budget", self.budget, 1, "a positive integer")
        _check_int("buffer", self.buffer, 0, "a non-negative integer")
        for name in ("prompt_length", "decode_steps", "repeats", "probe_steps", "max_measured_batch", "rounds"):
            _check_int(name, getattr(self, name), 1, "at least 1")
        _check_int("prefill_chunk", self.prefill_chunk, 0, ">= 0 (0: one forward)")
        for name in ("window", "threads"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, "at least 1")
        check_settings(self.quantized, self.bits)

    def _check_allocation(self) -> None:
        # the cache's own rule, before anything runs: a setting that does not apply to the allocation is refused
        ragged = False if self.padded_heads else None
        check_allocation_settings(
            self.allocation, budgets_file=self.budgets_file, adaptive_alpha=self.adaptive_alpha, ragged=ragged
        )
        rule = self.allocation_rule
        # the alpha the allocation runs with (its default when not given; None where it does not apply)
        object.__setattr__(self, "adaptive_alpha", rule.options().get("adaptive_alpha"))
        if not rule.per_head:
            return
        if self.quantized:
            raise ValueError(
                f"--allocation {self.allocation} cannot be combined with --quantized {self.quantized} (the cache "
                "keeps no quantized tier under an allocation): drop one of them"
            )
        others = [flag for flag, on in (("--eviction-cost", self.eviction_cost), ("--max-batch", self.max_batch)) if on]
        if others:
            raise ValueError(
                f"--allocation {self.allocation} applies to the length sweep only, not to {' and '.join(others)}"
            )

    @property
    def allocation_rule(self) -> Allocation:
        """The allocation every evicting entry of the length sweep runs under."""
        return allocation_rule(self.allocation, budgets_file=self.budgets_file, adaptive_alpha=self.adaptive_alpha)

    @property
    def allocation_config(self) -> dict[str, Any]:
        """What the sweep's records store of the allocation (nothing for ``uniform``, so that folders written
        before allocations existed resume)."""
        rule = self.allocation_rule
        if not rule.per_head:
            return {}
        return {"allocation": rule.name, "ragged_heads": not self.padded_heads, **rule.options()}

    def _check_eviction_cost(self) -> None:
        if self.cached is None:
            raise ValueError("--eviction-cost needs --cached N (the tokens the cache holds at each eviction)")
        if not is_int(self.cached) or not 1 <= self.buffer < self.cached:
            raise ValueError(
                f"--eviction-cost needs 1 <= --buffer < --cached (budget = cached - buffer), "
                f"got buffer {self.buffer} and cached {self.cached}"
            )

    def _check_sweep(self) -> None:
        lengths = self.sweep_lengths
        if self.prefill_to_length:
            if lengths[0] <= self.decode_steps + WARMUP_STEPS:
                raise ValueError(
                    f"--prefill-to-length: every length must exceed --decode-steps {self.decode_steps} plus "
                    f"{WARMUP_STEPS} warm-up steps, got {lengths[0]}"
                )
            if self.sweep_window > self.decode_steps:
                raise ValueError(f"--window {self.sweep_window} exceeds --decode-steps {self.decode_steps}")
        elif lengths[0] <= self.prompt_length:
            raise ValueError(f"every length must exceed --prompt-length {self.prompt_length}, got {lengths[0]}")

    def _check_ragged(self) -> None:
        if not (self.runs_sweep and self.prefill_to_length and max(self.batch_sizes) > 1):
            raise ValueError(
                "--ragged needs the length sweep with --prefill-to-length and a batch size above 1 "
                f"(--batch-sizes {_joined(self.batch_sizes)}): it staggers the rows of a batch"
            )
        batch = max(self.batch_sizes)
        untimed = WARMUP_STEPS + ragged_shifts(batch, self.buffer)[-1] + self.buffer + 1
        if self.sweep_lengths[0] <= self.decode_steps + untimed:
            raise ValueError(
                f"--ragged: every length must exceed --decode-steps {self.decode_steps} plus the {untimed} untimed "
                f"steps that stagger a batch of {batch} rows, got {self.sweep_lengths[0]}"
            )

    def _check_compile(self) -> None:
        try:
            compile_backend(self.compile)
        except ValueError as error:
            raise ValueError(f"--compile: {error}") from None
        if not self.runs_sweep:
            raise ValueError("--compile needs the length sweep (--lengths): it compiles the sweep's decode steps")

    def _check_max_batch(self) -> None:
        if self.memory_limit is None or self.length is None:
            raise ValueError("--max-batch needs --memory-limit (e.g. 24GiB) and --length L")
        _check_int("length", self.length, 1, "a positive integer")
        if self.length <= max(self.probe_steps, self.decode_steps) + WARMUP_STEPS:
            raise ValueError(
                f"--length {self.length} must exceed --decode-steps {self.decode_steps} and --probe-steps "
                f"{self.probe_steps} plus {WARMUP_STEPS} warm-up steps"
            )
        if len(self.probe_batches) != 2:
            raise ValueError(
                f"--probe-batches takes two different batch sizes, got {','.join(map(str, self.probe_batches))!r}"
            )
        parse_bytes(self.memory_limit)

    # ------------------------------------------------------------------ derived
    @property
    def runs_sweep(self) -> bool:
        """The length sweep runs when lengths are given or when nothing else is measured."""
        return self.lengths is not None or not (self.max_batch or self.eviction_cost)

    @property
    def modes(self) -> list[str]:
        """The measurements asked for, in measuring order."""
        chosen = {SWEEP: self.runs_sweep, EVICTION: self.eviction_cost, MAX_BATCH: self.max_batch}
        return [mode for mode, on in chosen.items() if on]

    @property
    def sweep_lengths(self) -> tuple[int, ...]:
        return DEFAULT_LENGTHS if self.lengths is None else self.lengths

    @property
    def sweep_window(self) -> int:
        """Decode steps per window: all the timed steps of a prefilled sweep; for a decoded one the smallest
        multiple of ``B`` >= 32, so that every window holds whole eviction cycles."""
        if self.window is not None:
            return self.window
        if self.prefill_to_length:
            return self.decode_steps
        return self.buffer * math.ceil(32 / self.buffer) if self.buffer else 32

    @property
    def compile_backend(self) -> str | None:
        """The ``torch.compile`` backend of the compiled variants (None: no ``--compile``)."""
        return compile_backend(self.compile)

    @property
    def memory_limit_bytes(self) -> int | None:
        return None if self.memory_limit is None else parse_bytes(self.memory_limit)

    # ------------------------------------------------------------------ the command line's view
    def command(self) -> str:
        """The command line that reproduces the run (every setting off its default, and the ones a reader needs)."""
        return shlex.join(["reasonkv", "bench", *spell(self)])

    def arguments(self) -> dict[str, Any]:
        """The settings as the command line's arguments (flag destinations and values), as recorded in
        ``bench.json``."""
        return {"command": "bench", **flag_values(self)}
