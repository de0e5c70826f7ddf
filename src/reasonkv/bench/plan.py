"""What one bench run measures, decided from its settings before any model is loaded.

:func:`build_plan` gives the entries (the requested policies, the references and the variants), their options
and caches (a bad option, or protected tokens beyond the budget, is a ``ValueError``, or a warning and a skip
under ``--policies all``) and per mode the configuration every record stores; doubtful but legal choices
become warnings.
"""

from __future__ import annotations

from dataclasses import dataclass

from reasonkv.bench.compiled import compiled_label
from reasonkv.bench.measure import WARMUP_STEPS
from reasonkv.bench.settings import EVICTION, MAX_BATCH, SWEEP, TRANSFORMERS, BenchSettings
from reasonkv.bench.tiers import tier_label
from reasonkv.bench.variants import ragged_label
from reasonkv.cache import CacheSpec
from reasonkv.policies import Policy, get_policy, list_policies, options_by_policy, policy_class

__all__ = ["REFERENCES", "Plan", "build_plan", "reference_lengths"]

REFERENCES = ("full", "streaming")  # always measured, whatever --policies says


def reference_lengths(*, evicts: bool, budget: int, buffer: int, lengths: list[int], prefill: bool) -> list[int]:
    """Extra lengths the summary needs: ``K + B/2`` (the full-cache step the eviction overhead is compared with),
    ``K`` and ``8 K`` (flatness). A decode sweep gets them all for free; a prefilled sweep only those its policy
    needs (each costs a prefill); none beyond the largest requested length."""
    top = max(lengths)
    if not prefill:
        wanted = [budget, budget + buffer // 2, 8 * budget]
    elif evicts:
        wanted = [budget, 8 * budget]
    else:
        wanted = [budget + buffer // 2]
    return sorted({tokens for tokens in wanted if tokens <= top} - set(lengths))


@dataclass(frozen=True)
class Plan:
    """What to measure: the entries (policies with their options and caches) and one configuration per mode.

    ``policies``: the requested ones, the references (``full``, ``streaming``, ``transformers``) and the
    variants. ``specs[mode][entry]`` is the entry's cache in that mode (``None``: transformers' own cache; a
    tiered variant holds its plain policy's, tiered once the model gives the bytes of a token).
    """

    settings: BenchSettings
    policies: list[str]
    requested: list[str]
    options: dict[str, dict]
    instances: dict[str, Policy | None]  # entry -> its policy (None: transformers' own cache)
    specs: dict[str, dict[str, CacheSpec | None]]
    tiers: dict[str, dict]  # tiered variant -> its policy, quantized, bits
    configs: dict[str, dict]
    warnings: list[str]
    ragged: dict[str, str]  # ragged variant -> its policy
    compiled: dict[str, str]  # compiled variant -> its entry

    @property
    def modes(self) -> list[str]:
        return self.settings.modes

    @property
    def evicts(self) -> dict[str, bool]:
        return {name: policy is not None and policy.evicts for name, policy in self.instances.items()}

    @property
    def selects(self) -> dict[str, bool]:
        """Whether each entry's policy selects (holds every token, reads a part each decode step)."""
        return {name: policy is not None and policy.selects for name, policy in self.instances.items()}

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.settings.batch_sizes)

    def entries(self) -> list[tuple[str, str, int | None]]:
        """``(mode, policy, batch)`` in measuring order: policy by policy within each mode."""
        out: list[tuple[str, str, int | None]] = []
        for mode in self.modes:
            batches = self.batch_sizes if mode == SWEEP else [1] if mode == EVICTION else [None]
            for p in self.policies:
                if p in self.specs[mode]:
                    out += [(mode, p, b) for b in batches if b is None or b > 1 or p not in self.ragged]
        return out

    def sweep_lengths(self, policy: str) -> list[int]:
        config = self.configs[SWEEP]
        if policy in self.ragged or not self.settings.reference_lengths:  # the requested lengths only
            return list(config["lengths"])
        extra = reference_lengths(
            evicts=self.evicts[policy],
            budget=config["budget"],
            buffer=config["buffer"],
            lengths=config["lengths"],
            prefill=config["prefill_to_length"],
        )
        low = config["decode_steps"] + WARMUP_STEPS if config["prefill_to_length"] else config["prompt_length"]
        return sorted(set(config["lengths"]) | {tokens for tokens in extra if tokens > low})


def _policies(names: tuple[str, ...]) -> tuple[list[str], list[str], bool]:
    """The entries (references first), the requested policies, and whether 'all' was asked for."""
    everything = "all" in names
    if everything:
        names = (*(n for n in names if n != "all"), *list_policies())
    for name in names:
        policy_class(name)  # raises ValueError listing the valid names
    requested = list(dict.fromkeys(names))
    return list(dict.fromkeys([*REFERENCES, *requested])), requested, everything


def _measured_in(mode: str, name: str, policy: Policy, requested: list[str]) -> bool:
    if mode == EVICTION:
        return policy.evicts and (name in requested or name == "streaming")
    if mode == MAX_BATCH:
        return name in requested or name == "full"
    return True


def _spec(settings: BenchSettings, mode: str, policy: Policy) -> CacheSpec:
    """The entry's cache in ``mode`` (the full cache stores no budget: it evicts nothing); an evicting entry of the
    length sweep under the settings' allocation."""
    budget = settings.cached - settings.buffer if mode == EVICTION else settings.budget
    rule, shared = settings.allocation_rule, {}
    if mode == SWEEP and policy.evicts and rule.per_head:
        shared = dict(allocation=rule.name, ragged=not settings.padded_heads, **rule.options())
    return CacheSpec(policy, budget, settings.buffer, seed=settings.seed, **shared)


def _unallocated(settings: BenchSettings, requested: list[str], everything: bool) -> list[str]:
    """An allocation shares an evicting policy's budget among heads: a selection policy, which holds every token,
    has none to share. Under ``--policies all`` the selection policies are left out (returned); named, refused."""
    if not settings.allocation_rule.per_head:
        return []
    selecting = [name for name in requested if policy_class(name).selects]
    if selecting and not everything:
        raise ValueError(
            f"--allocation {settings.allocation} applies to evicting policies; {', '.join(selecting)} "
            f"select{'s' if len(selecting) == 1 else ''} (every token held, a part read each step): measure "
            "them in a run without --allocation"
        )
    return selecting


def build_plan(settings: BenchSettings) -> Plan:
    """The plan of ``settings`` (``ValueError`` for a policy, option or cache that cannot be measured)."""
    policies, requested, everything = _policies(settings.policies)
    skipped = _unallocated(settings, requested, everything)
    policies = [p for p in policies if p not in skipped]
    requested = [p for p in requested if p not in skipped]
    options = options_by_policy(policies, list(settings.option))
    instances: dict[str, Policy | None] = {}
    specs: dict[str, dict[str, CacheSpec | None]] = {mode: {} for mode in settings.modes}
    warnings: list[str] = []
    if skipped:
        warnings.append(
            f"skipping {', '.join(skipped)} under --allocation {settings.allocation}: a selection policy holds "
            "every token (no budget to share among heads)"
        )
    for name in list(policies):
        policy = get_policy(name, **options[name])  # bad option values raise here
        try:
            caches = {
                mode: _spec(settings, mode, policy)
                for mode in settings.modes
                if _measured_in(mode, name, policy, requested)
            }
        except ValueError as error:  # its protected tokens do not fit a budget
            if everything and name not in REFERENCES:
                warnings.append(f"skipping {error}")
                policies.remove(name)
                continue
            raise
        instances[name] = policy
        for mode, spec in caches.items():
            specs[mode][name] = spec
    requested = [p for p in requested if p in policies]
    tiers = _tier_variants(settings, [p for p in requested if instances[p].evicts])
    prefilled = settings.runs_sweep and settings.prefill_to_length
    if settings.transformers_cache or (settings.compile is not False and prefilled):
        policies.insert(policies.index("full") + 1, TRANSFORMERS)
        options[TRANSFORMERS] = {}
        instances[TRANSFORMERS] = None
        specs[SWEEP][TRANSFORMERS] = None
    ragged = {ragged_label(p): p for p in requested if instances[p].evicts} if settings.ragged else {}
    compiled = _compiled_variants(settings, policies, specs, everything, warnings)
    variants = [*((label, tier["policy"]) for label, tier in tiers.items()), *ragged.items(), *compiled.items()]
    for label, policy in variants:
        # A compiled variant is measured right after its entry, so that the machine's load is alike for both.
        at = policies.index(policy) + 1 if label in compiled else len(policies)
        policies.insert(at, label)
        requested.append(label)
        options[label] = options[policy]
        instances[label] = instances[policy]
        if SWEEP in specs:  # variants are measured in the length sweep only
            specs[SWEEP][label] = specs[SWEEP][policy]
    return Plan(
        settings=settings,
        policies=policies,
        requested=requested,
        options={p: options[p] for p in policies},
        instances=instances,
        specs=specs,
        tiers=tiers,
        configs=_configs(settings, tiers, warnings),
        warnings=warnings,
        ragged=ragged,
        compiled=compiled,
    )


def _compiled_variants(
    settings: BenchSettings, policies: list[str], specs: dict, everything: bool, warnings: list[str]
) -> dict[str, str]:
    """``--compile``: a compiled variant of every entry of the length sweep whose cache a compiled step runs (its
    spec says; transformers' own cache always). Under ``--policies all`` the others are measured eagerly only (a
    warning says why); named, refused."""
    if settings.compile is False or SWEEP not in specs:
        return {}
    compiled = {}
    for name in (p for p in policies if p in specs[SWEEP]):
        spec = specs[SWEEP][name]
        try:
            if spec is not None:
                spec.check_compile()
        except ValueError as error:
            if not everything:
                raise ValueError(f"--compile: {error}") from None
            warnings.append(f"skipping {compiled_label(name)}: {error}")
            continue
        compiled[compiled_label(name)] = name
    return compiled


def _tier_variants(settings: BenchSettings, evicting: list[str]) -> dict[str, dict]:
    """``--quantized Q --bits b``: a tiered variant of every requested evicting policy (length sweep only)."""
    if not settings.quantized:
        return {}
    quantized, bits = settings.quantized, 8 if settings.bits is None else settings.bits
    if not evicting:
        raise ValueError("--quantized needs at least one evicting policy in --policies to compare")
    unranked = [p for p in evicting if not policy_class(p).can_rank()]
    if unranked:
        raise ValueError(f"{', '.join(unranked)} cannot fill a quantized tier (they do not rank tokens)")
    return {tier_label(p, quantized, bits): {"policy": p, "quantized": quantized, "bits": bits} for p in evicting}


def _configs(settings: BenchSettings, tiers: dict[str, dict], warnings: list[str]) -> dict[str, dict]:
    """Per mode, what its records store: a folder resumes only with the same (:mod:`reasonkv.bench.store`)."""
    s = settings
    common = _fields(s, "model", "dtype", "device", "attn", "seed")
    if tiers:  # only then, so that plain runs resume folders written before tiers existed
        common.update(quantized=s.quantized, bits=tiers[next(iter(tiers))]["bits"])
    configs = {}
    if s.runs_sweep:
        configs[SWEEP] = _sweep_config(s, common, warnings)
    if s.eviction_cost:
        configs[EVICTION] = {**common, **_fields(s, "cached", "buffer", "repeats", "prefill_chunk", "prompt_length")}
    if s.max_batch:
        configs[MAX_BATCH] = {
            **common,
            **_fields(s, "budget", "buffer", "length", "memory_limit_bytes", "decode_steps"),
            "probe_batches": sorted(s.probe_batches),
            **_fields(s, "probe_steps", "max_measured_batch", "prefill_chunk", "prompt_length"),
        }
    return configs


def _fields(settings: BenchSettings, *names: str) -> dict:
    """The settings' values of the fields ``names``, by name, in that order."""
    return {name: getattr(settings, name) for name in names}


def _sweep_config(s: BenchSettings, common: dict, warnings: list[str]) -> dict:
    lengths, budget, buffer, window = list(s.sweep_lengths), s.budget, s.buffer, s.sweep_window
    config = {**common, "budget": budget, "buffer": buffer, "lengths": lengths, "sync_timing": s.sync_timing}
    config["rounds"] = s.rounds
    config.update(s.allocation_config)  # nothing under the uniform allocation
    if not s.reference_lengths:  # only then, so that folders written before the choice existed resume
        config["reference_lengths"] = False
    if s.ragged:  # only then, so that folders written before ragged variants existed resume
        config["ragged"] = True
    if s.compile is not False:  # likewise
        config["compile"] = s.compile_backend
    config.update(_fields(s, "prefill_to_length", "prompt_length"))
    if s.prefill_to_length:
        config.update(_fields(s, "decode_steps", "prefill_chunk"))
    config["window"] = window
    if s.prefill_to_length and buffer and window % buffer and window >= buffer:
        warnings.append(
            f"window {window} is not a multiple of the buffer {buffer}: amortised eviction costs depend "
            "on how many evictions fall into it"
        )
    if budget >= lengths[0]:
        warnings.append(f"budget {budget} >= the smallest length {lengths[0]}: nothing is evicted up to that length")
    if budget + buffer > lengths[-1]:
        warnings.append(f"K + B = {budget + buffer} exceeds the largest length {lengths[-1]}: no eviction at all")
    return config
