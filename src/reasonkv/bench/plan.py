"""Turning ``reasonkv bench`` arguments into a checked plan, before any model is loaded.

Every mistake that can be caught from the arguments alone is a ``ValueError`` naming the bad
value and what is allowed; doubtful but legal choices become warnings.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

__all__ = ["DEFAULT_LENGTHS", "TRANSFORMERS", "Plan", "build_plan", "parse_int_list", "reference_lengths"]

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
SWEEP, EVICTION, MAX_BATCH = "sweep", "eviction-cost", "max-batch"
TRANSFORMERS = "transformers"  # the sweep's reference entry: transformers' own cache, no reasonkv hook


def parse_int_list(text: str, what: str, *, increasing: bool = False) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]``: positive integers (strictly increasing if asked)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{what}: expected comma-separated positive integers, got {text!r}")
    values = []
    for part in parts:
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not an integer (in {text!r})") from None
        if value <= 0:
            raise ValueError(f"{what}: {value} is not positive (in {text!r})")
        values.append(value)
    if increasing and any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{what} must be strictly increasing, got {text!r}")
    if not increasing and len(set(values)) != len(values):
        raise ValueError(f"{what}: repeated values in {text!r}")
    return values


def reference_lengths(*, evicts: bool, budget: int, buffer: int, lengths: list[int], prefill: bool) -> list[int]:
    """Extra lengths the summary needs besides the requested ones.

    ``K + B/2`` (the full-cache step the eviction overhead is compared with), ``K`` and ``8 K``
    (flatness). A decode sweep gets them all for free; a prefilled sweep measures only those its
    policy needs (each costs a prefill), and never beyond the largest requested length.
    """
    top = max(lengths)
    if not prefill:
        wanted = [budget, budget + buffer // 2, 8 * budget]
    elif evicts:
        wanted = [budget, 8 * budget]
    else:
        wanted = [budget + buffer // 2]
    return sorted({tokens for tokens in wanted if tokens <= top} - set(lengths))


@dataclass
class Plan:
    """What to measure: policies with their options, and one configuration per mode.

    ``policies`` holds the requested ones plus the references: ``full`` and ``streaming`` for the
    sweep (and ``transformers``, transformers' own cache, with ``--transformers-cache``), ``streaming``
    for the eviction cost, ``full`` for the max batch.
    """

    model: str
    dtype: str
    device: str
    attn: str
    policies: list[str]
    options: dict[str, dict]
    evicts: dict[str, bool]
    requested: list[str]
    batch_sizes: list[int]
    configs: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    tiers: dict[str, dict] = field(default_factory=dict)  # tiered variant -> its policy, quantized, bits

    @property
    def modes(self) -> list[str]:
        return [m for m in (SWEEP, EVICTION, MAX_BATCH) if m in self.configs]

    def entries(self) -> list[tuple[str, str, int | None]]:
        """``(mode, policy, batch)`` in measuring order: policy by policy within each mode."""
        out: list[tuple[str, str, int | None]] = []
        if SWEEP in self.configs:
            out += [(SWEEP, p, b) for p in self.policies for b in self.batch_sizes]
        plain = [p for p in self.policies if p not in self.tiers]  # tiered variants run in the sweep only
        if EVICTION in self.configs:
            chosen = [p for p in plain if self.evicts[p] and (p in self.requested or p == "streaming")]
            out += [(EVICTION, p, 1) for p in chosen]
        if MAX_BATCH in self.configs:
            out += [(MAX_BATCH, p, None) for p in plain if p in self.requested or p == "full"]
        return out

    def sweep_lengths(self, policy: str) -> list[int]:
        config = self.configs[SWEEP]
        extra = reference_lengths(
            evicts=self.evicts[policy],
            budget=config["budget"],
            buffer=config["buffer"],
            lengths=config["lengths"],
            prefill=config["prefill_to_length"],
        )
        from reasonkv.bench.measure import WARMUP_STEPS

        low = config["decode_steps"] + WARMUP_STEPS if config["prefill_to_length"] else config["prompt_length"]
        return sorted(set(config["lengths"]) | {tokens for tokens in extra if tokens > low})


def _policies(text: str) -> tuple[list[str], list[str], bool]:
    from reasonkv.policies import list_policies, policy_class

    names = [p.strip() for p in str(text).split(",") if p.strip()]
    if not names:
        raise ValueError("--policies: give policy names separated by commas, or 'all'")
    everything = "all" in names
    if everything:
        names = [n for n in names if n != "all"] + list_policies()
    for name in names:
        policy_class(name)  # raises ValueError listing the valid names
    requested = list(dict.fromkeys(names))
    return list(dict.fromkeys(["full", "streaming", *requested])), requested, everything


def _options(pairs: list[str], policies: list[str]) -> dict[str, dict]:
    from reasonkv.policies import options_by_policy

    return options_by_policy(policies, pairs)


def _fits(policy, budget: int) -> str | None:
    reserved = policy.sinks + policy.window
    if reserved > budget:
        return f"{policy.name}: sinks ({policy.sinks}) + window ({policy.window}) exceed the budget {budget}"
    return None


def build_plan(args: argparse.Namespace) -> Plan:
    """Check every argument and return the plan (``ValueError`` for anything wrong)."""
    from reasonkv.models import SHAPE_PREFIX, resolve_attn_implementation, resolve_device, resolve_dtype, shape_config
    from reasonkv.policies import get_policy

    dtype = resolve_dtype(args.dtype)
    device = resolve_device(args.device)
    resolve_attn_implementation(args.attn, dtype, device)
    if args.model.startswith(SHAPE_PREFIX):
        shape_config(args.model[len(SHAPE_PREFIX) :])  # unknown shapes fail here, listing the known ones
    if args.budget <= 0:
        raise ValueError(f"--budget must be a positive integer, got {args.budget}")
    if args.buffer < 0:
        raise ValueError(f"--buffer must be a non-negative integer, got {args.buffer}")
    for name in ("prompt_length", "decode_steps", "repeats", "probe_steps", "max_measured_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be >= 0 (0: one forward), got {args.prefill_chunk}")
    if args.window is not None and args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")

    policies, requested, everything = _policies(args.policies)
    options = _options(args.option, policies)
    warnings: list[str] = []
    budgets = []
    do_sweep = args.lengths is not None or not (args.max_batch or args.eviction_cost)
    if do_sweep or args.max_batch:
        budgets.append(args.budget)
    if args.eviction_cost:
        if args.cached is None:
            raise ValueError("--eviction-cost needs --cached N (the tokens the cache holds at each eviction)")
        if args.buffer < 1 or args.cached <= args.buffer:
            raise ValueError(
                f"--eviction-cost needs 1 <= --buffer < --cached (budget = cached - buffer), "
                f"got buffer {args.buffer} and cached {args.cached}"
            )
        budgets.append(args.cached - args.buffer)
    instances = {}
    for name in list(policies):
        instances[name] = get_policy(name, **options[name])  # bad option values raise here
        problems = [p for p in (_fits(instances[name], b) for b in budgets) if p] if instances[name].evicts else []
        if problems:
            if everything and name not in ("full", "streaming"):
                warnings.append(f"skipping {problems[0]}")
                policies.remove(name)
                continue
            raise ValueError(problems[0])
    tiers = _tier_variants(args, [p for p in requested if p in policies and instances[p].evicts])
    if getattr(args, "transformers_cache", False):
        if not args.prefill_to_length or not do_sweep:
            raise ValueError(
                "--transformers-cache needs the length sweep with --prefill-to-length (the decode sweep runs "
                "reasonkv.generate, which always decodes through an EvictingCache)"
            )
        policies.insert(policies.index("full") + 1, TRANSFORMERS)
        options[TRANSFORMERS] = {}
        instances[TRANSFORMERS] = instances["full"]  # never evicts
    plan = Plan(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attn=args.attn,
        policies=policies,
        options={p: options[p] for p in policies},
        evicts={p: instances[p].evicts for p in policies},
        requested=[p for p in requested if p in policies],
        batch_sizes=sorted(parse_int_list(args.batch_sizes, "--batch-sizes")),
        warnings=warnings,
        tiers=tiers,
    )
    for label, tier in tiers.items():
        plan.policies.append(label)
        plan.requested.append(label)
        plan.options[label] = plan.options[tier["policy"]]
        plan.evicts[label] = True
    common = {"model": args.model, "dtype": args.dtype, "device": args.device, "attn": args.attn, "seed": args.seed}
    if tiers:  # only then, so that plain runs resume folders written before tiers existed
        common.update(quantized=args.quantized, bits=tiers[next(iter(tiers))]["bits"])
    if do_sweep:
        plan.configs[SWEEP] = _sweep_config(args, common, warnings)
    if args.eviction_cost:
        plan.configs[EVICTION] = {
            **common,
            "cached": args.cached,
            "buffer": args.buffer,
            "repeats": args.repeats,
            "prefill_chunk": args.prefill_chunk,
            "prompt_length": args.prompt_length,
        }
    if args.max_batch:
        plan.configs[MAX_BATCH] = _max_batch_config(args, common)
    return plan


def _tier_variants(args: argparse.Namespace, evicting: list[str]) -> dict[str, dict]:
    """``--quantized Q --bits b``: a tiered variant of every requested evicting policy (length sweep only)."""
    from reasonkv.bench.tiers import tier_label
    from reasonkv.cache.tiers import check_settings
    from reasonkv.policies import policy_class

    quantized, bits = getattr(args, "quantized", 0), getattr(args, "bits", None)
    check_settings(quantized, bits)
    if not quantized:
        return {}
    bits = 8 if bits is None else bits
    if not evicting:
        raise ValueError("--quantized needs at least one evicting policy in --policies to compare")
    unranked = [p for p in evicting if not policy_class(p).can_rank()]
    if unranked:
        raise ValueError(f"{', '.join(unranked)} cannot fill a quantized tier (they do not rank tokens)")
    return {tier_label(p, quantized, bits): {"policy": p, "quantized": quantized, "bits": bits} for p in evicting}


def _sweep_config(args: argparse.Namespace, common: dict, warnings: list[str]) -> dict:
    lengths = parse_int_list(args.lengths or ",".join(map(str, DEFAULT_LENGTHS)), "--lengths", increasing=True)
    budget, buffer = args.budget, args.buffer
    config = {**common, "budget": budget, "buffer": buffer, "lengths": lengths}
    config["sync_timing"] = not args.no_sync_timing
    if args.prefill_to_length:
        from reasonkv.bench.measure import WARMUP_STEPS

        if lengths[0] <= args.decode_steps + WARMUP_STEPS:
            raise ValueError(
                f"--prefill-to-length: every length must exceed --decode-steps {args.decode_steps} plus "
                f"{WARMUP_STEPS} warm-up steps, got {lengths[0]}"
            )
        window = args.window or args.decode_steps
        if window > args.decode_steps:
            raise ValueError(f"--window {window} exceeds --decode-steps {args.decode_steps}")
        config.update(
            prefill_to_length=True,
            prompt_length=args.prompt_length,
            decode_steps=args.decode_steps,
            prefill_chunk=args.prefill_chunk,
            window=window,
        )
        if buffer and window % buffer and window >= buffer:
            warnings.append(
                f"window {window} is not a multiple of the buffer {buffer}: amortised eviction costs depend "
                "on how many evictions fall into it"
            )
    else:
        if lengths[0] <= args.prompt_length:
            raise ValueError(f"every length must exceed --prompt-length {args.prompt_length}, got {lengths[0]}")
        window = args.window or (buffer * math.ceil(32 / buffer) if buffer else 32)
        config.update(prefill_to_length=False, prompt_length=args.prompt_length, window=window)
    if budget >= lengths[0]:
        warnings.append(f"budget {budget} >= the smallest length {lengths[0]}: nothing is evicted up to that length")
    if budget + buffer > lengths[-1]:
        warnings.append(f"K + B = {budget + buffer} exceeds the largest length {lengths[-1]}: no eviction at all")
    return config


def _max_batch_config(args: argparse.Namespace, common: dict) -> dict:
    from reasonkv.bench.measure import WARMUP_STEPS
    from reasonkv.bench.memory import parse_bytes

    if args.memory_limit is None or args.length is None:
        raise ValueError("--max-batch needs --memory-limit (e.g. 24GiB) and --length L")
    if args.length <= max(args.probe_steps, args.decode_steps) + WARMUP_STEPS:
        raise ValueError(
            f"--length {args.length} must exceed --decode-steps {args.decode_steps} and --probe-steps "
            f"{args.probe_steps} plus {WARMUP_STEPS} warm-up steps"
        )
    probes = parse_int_list(args.probe_batches, "--probe-batches")
    if len(probes) != 2:
        raise ValueError(f"--probe-batches takes two different batch sizes, got {args.probe_batches!r}")
    return {
        **common,
        "budget": args.budget,
        "buffer": args.buffer,
        "length": args.length,
        "memory_limit_bytes": parse_bytes(args.memory_limit),
        "decode_steps": args.decode_steps,
        "probe_batches": sorted(probes),
        "probe_steps": args.probe_steps,
        "max_measured_batch": args.max_measured_batch,
        "prefill_chunk": args.prefill_chunk,
        "prompt_length": args.prompt_length,
    }
