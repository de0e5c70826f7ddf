"""``reasonkv bench``'s settings: one frozen object, every flag a typed field, checked once.

:class:`BenchSettings` is what the command line builds from its arguments (:mod:`reasonkv.cli.bench`)
and what a Python caller builds directly; the plan (:func:`reasonkv.bench.plan.build_plan`) and the run
(:func:`reasonkv.bench.run.run_bench`) read nothing else. Building one checks every value and every
combination that needs no model and no policy: a mistake is a ``ValueError`` naming the flag, the bad
value and what is allowed, raised before any folder is touched. The lists the command line takes as
comma-separated text (``--lengths 1024,2048``) may be given as that text or as sequences.
"""

from __future__ import annotations

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
from reasonkv.cache.spec import DEFAULT_ADAPTIVE_ALPHA, check_allocation_settings
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
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, Sequence):
        parts = list(value)
    else:
        raise ValueError(f"{what}: expected comma-separated positive integers, got {value!r}")
    if not parts:
        raise ValueError(f"{what}: expected comma-separated positive integers, got {value!r}")
    values = []
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (int, str)):
            raise ValueError(f"{what}: {part!r} is not an integer (in {value!r})")
        try:
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


_SWITCHES = ("prefill_to_length", "transformers_cache", "sync_timing", "ragged", "eviction_cost", "max_batch", "force")
_SWITCHES += ("progress", "plots", "reference_lengths", "padded_heads")
DEFAULT_ROUNDS = 3  # the sweep's interleaved rounds: an odd count, so the median is one round's


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_int(name: str, value: Any, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_flag(name)} must be {what}, got {value}")


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """Everything one ``reasonkv bench`` run is told (the fields are its flags, in their order).

    Model: ``model``, ``dtype``, ``device``, ``attn``, ``threads`` (CPU threads for torch; None: torch's
    choice). Policies: ``policies`` (names, or ``("all",)``), ``option`` (``KEY=VALUE`` or
    ``POLICY.KEY=VALUE`` strings), ``budget`` ``K``, ``buffer`` ``B``, ``seed`` (prompts and policies),
    ``quantized``/``bits`` (a quantized-tier variant of each requested evicting policy), ``allocation``,
    ``budgets_file``, ``adaptive_alpha``, ``padded_heads`` (how ``K x layers x kv-heads`` is shared among the
    layers' kv-heads, :mod:`reasonkv.cache.allocation`: every evicting entry of the length sweep runs under it,
    its heads in ragged storage unless ``padded_heads``). Length sweep:
    ``lengths`` (None: :data:`DEFAULT_LENGTHS`, and the sweep runs only when no other measurement is
    asked for), ``reference_lengths`` (also the lengths the summary's overhead and flatness compare with:
    ``K``, ``K + B/2``, ``8 K``), ``rounds`` (the sweep's entries of a batch size measured in that many
    interleaved rounds, the median kept: :mod:`reasonkv.bench.rounds`), ``batch_sizes``, ``prompt_length``,
    ``window`` (None: see :attr:`sweep_window`),
    ``prefill_to_length``, ``transformers_cache``, ``decode_steps``, ``sync_timing``, ``prefill_chunk``,
    ``ragged`` (a variant of each requested evicting policy whose rows are prefilled to lengths ``B /
    batch`` apart, so that they evict at different steps, beside the one whose rows evict together), ``compile``
    (each plain entry again as ``ENTRY~compiled``, its decode steps compiled: ``True`` for inductor, or a
    ``torch.compile`` backend's name; with ``prefill_to_length`` also the pair ``transformers`` /
    ``transformers~compiled``).
    Eviction cost: ``eviction_cost``, ``cached`` ``N``, ``repeats``. Max batch: ``max_batch``,
    ``memory_limit`` (as written: ``"24GiB"``), ``length``, ``probe_batches``, ``probe_steps``,
    ``max_measured_batch``. Output: ``out``, ``force``, ``progress``, ``plots``.
    """

    model: str = DEFAULT_MODEL
    dtype: str = DEFAULT_DTYPE
    device: str = "cpu"
    attn: str = "sdpa"
    threads: int | None = None
    policies: tuple[str, ...] = ("all",)
    option: tuple[str, ...] = ()
    budget: int = 512
    buffer: int = DEFAULT_BUFFER
    seed: int = 0
    quantized: int = 0
    bits: int | None = None
    allocation: str = "uniform"
    budgets_file: str | None = None
    adaptive_alpha: float | None = None
    padded_heads: bool = False
    lengths: tuple[int, ...] | None = None
    reference_lengths: bool = True
    rounds: int = DEFAULT_ROUNDS
    batch_sizes: tuple[int, ...] = (1,)
    prompt_length: int = 32
    window: int | None = None
    prefill_to_length: bool = False
    transformers_cache: bool = False
    decode_steps: int = 256
    sync_timing: bool = True
    prefill_chunk: int = 0
    ragged: bool = False
    compile: bool | str = False
    eviction_cost: bool = False
    cached: int | None = None
    repeats: int = 5
    max_batch: bool = False
    memory_limit: str | None = None
    length: int | None = None
    probe_batches: tuple[int, ...] = (1, 2)
    probe_steps: int = 4
    max_measured_batch: int = 256
    out: Path
    force: bool = False
    progress: bool = True
    plots: bool = True

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
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"--seed must be an integer, got {self.seed!r}")
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
        device = resolve_device(self.device)
        resolve_attn_implementation(self.attn, dtype, device)
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
        if self.allocation == "adaptive" and self.adaptive_alpha is None:
            object.__setattr__(self, "adaptive_alpha", DEFAULT_ADAPTIVE_ALPHA)
        if self.allocation == "uniform":
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
    def allocation_config(self) -> dict[str, Any]:
        """What the sweep's records store of the allocation (nothing for ``uniform``, so that folders written
        before allocations existed resume)."""
        if self.allocation == "uniform":
            return {}
        config: dict[str, Any] = {"allocation": self.allocation, "ragged_heads": not self.padded_heads}
        if self.allocation == "adaptive":
            config["adaptive_alpha"] = self.adaptive_alpha
        if self.budgets_file is not None:
            config["budgets_file"] = os.fspath(self.budgets_file)
        return config

    def _check_eviction_cost(self) -> None:
        if self.cached is None:
            raise ValueError("--eviction-cost needs --cached N (the tokens the cache holds at each eviction)")
        if isinstance(self.cached, bool) or not isinstance(self.cached, int) or not 1 <= self.buffer < self.cached:
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
        """The command line with every setting spelled out (what reproduces the run)."""
        words = ["reasonkv", "bench", "--model", self.model, "--dtype", self.dtype, "--device", self.device]
        words += ["--attn", self.attn, "--policies", ",".join(self.policies), "--budget", str(self.budget)]
        if self.threads is not None:
            words += ["--threads", str(self.threads)]
        words += ["--buffer", str(self.buffer), "--seed", str(self.seed), "--batch-sizes", _joined(self.batch_sizes)]
        if self.quantized:
            words += ["--quantized", str(self.quantized), "--bits", str(self.bits or 8)]
        if self.allocation != "uniform":
            words += ["--allocation", self.allocation]
            if self.budgets_file is not None:
                words += ["--budgets-file", os.fspath(self.budgets_file)]
            if self.allocation == "adaptive":
                words += ["--adaptive-alpha", str(self.adaptive_alpha)]
            if self.padded_heads:
                words.append("--padded-heads")
        for option in self.option:
            words += ["-o", option]
        if self.lengths is not None:
            words += ["--lengths", _joined(self.lengths)]
        if not self.reference_lengths:
            words.append("--no-reference-lengths")
        words += ["--rounds", str(self.rounds)]
        words += ["--prompt-length", str(self.prompt_length)]
        if self.window is not None:
            words += ["--window", str(self.window)]
        if self.prefill_to_length:
            words.append("--prefill-to-length")
        if self.transformers_cache:
            words.append("--transformers-cache")
        words += ["--decode-steps", str(self.decode_steps), "--prefill-chunk", str(self.prefill_chunk)]
        if not self.sync_timing:
            words.append("--no-sync-timing")
        if self.ragged:
            words.append("--ragged")
        if self.compile is True:
            words.append("--compile")
        elif self.compile:
            words += ["--compile", self.compile]
        if self.eviction_cost:
            words += ["--eviction-cost", "--cached", str(self.cached), "--repeats", str(self.repeats)]
        if self.max_batch:
            words += ["--max-batch", "--memory-limit", str(self.memory_limit), "--length", str(self.length)]
            words += ["--probe-batches", _joined(self.probe_batches), "--probe-steps", str(self.probe_steps)]
            words += ["--max-measured-batch", str(self.max_measured_batch)]
        words += ["--out", str(self.out)]
        if self.force:
            words.append("--force")
        return shlex.join(words)

    def arguments(self) -> dict[str, Any]:
        """The settings as the command line's arguments (flag destinations and values), as recorded in
        ``bench.json``."""
        values: dict[str, Any] = {"command": "bench"}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name in ("sync_timing", "progress", "plots", "reference_lengths"):
                name, value = f"no_{name}", not value
            elif name == "policies":
                value = ",".join(value)
            elif name in ("batch_sizes", "probe_batches") or (name == "lengths" and value is not None):
                value = _joined(value)
            elif name == "option":
                value = list(value)
            elif name == "out":
                value = str(value)
            values[name] = value
        return values


def _joined(values: Sequence[int]) -> str:
    return ",".join(map(str, values))
