"""What an evicting cache keeps: one frozen settings object, validated once.

Building a :class:`CacheSpec` checks everything that needs no model: sizes, the tier's settings, that a
policy that evicts has a budget (the full cache ignores it), that its protected tokens fit, that a policy
filling a tier ranks tokens, and that an allocation's own settings come only with it. ``reasonkv.generate``,
:class:`~reasonkv.cache.EvictingCache`, the replays, the eval grid and the bench all take one."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from reasonkv.cache.allocation import (
    ALLOCATION_SETTINGS,
    ALLOCATIONS,
    DEFAULT_ADAPTIVE_ALPHA,
    Allocation,
    Uniform,
    allocation_class,
    allocation_rule,
    check_allocation_settings,
)
from reasonkv.cache.tiers import check_settings
from reasonkv.policies import Policy, check_fields, get_policy
from reasonkv.selection.blocks import blocks_per_step
from reasonkv.suggest.integers import check_int, is_int

__all__ = [
    "ALLOCATIONS",
    "ALLOCATION_SETTINGS",
    "DEFAULT_ADAPTIVE_ALPHA",
    "DEFAULT_BUFFER",
    "CacheSpec",
    "check_allocation_settings",
    "check_sizes",
    "resolve_spec",
]

DEFAULT_BUFFER = 128  # B: new tokens between two evictions


def check_sizes(budget: int | None, buffer: int) -> None:
    """``budget`` a positive integer or None, ``buffer`` a non-negative integer."""
    if budget is not None and (not is_int(budget) or budget <= 0):
        raise ValueError(f"budget must be a positive integer (or None for no eviction), got {budget!r}")
    check_int("buffer", buffer, 0)


def _seed(seed: Any) -> int | tuple[int, ...]:
    """One integer for every row, or one per row."""
    if is_int(seed):
        return seed
    if isinstance(seed, Iterable) and not isinstance(seed, (str, bytes)):
        seeds = tuple(seed)
        if seeds and all(is_int(s) for s in seeds):
            return seeds
    raise ValueError(f"seed must be an integer or a list of integers (one per prompt), got {seed!r}")


@dataclass(frozen=True)
class CacheSpec:
    """The settings of an evicting cache.

    Parameters
    ----------
    policy
        A registered policy name or instance (each cache works on its own copy).
    budget
        ``K``: tokens per (row, layer, kv-head) that survive an eviction; required by a policy that evicts, and
        by a selection policy (what a decode step reads); None for the full cache.
    buffer
        ``B``: tokens that may accumulate after an eviction; a row is evicted when it holds ``K + B``.
    quantized, bits, group_size
        The quantized tier: ``Q`` tokens per head at ``bits`` (4 or 8; default 8) beside the ``K`` at full
        precision, ``group_size`` numbers per scale and zero point (default: 32 or the largest divisor of
        head_dim below it). ``quantized=0``: no tier.
    seed
        The eviction randomness of each row: one integer, or one per row (``reasonkv.generate`` samples from it
        too, unless given its own sampling ``seed``).
    allocation
        How the budget is shared among (layer, kv-head): ``uniform``, ``pyramid``, ``adaptive`` or ``calibrated``
        (:mod:`reasonkv.cache.allocation`; :attr:`allocation_rule` is its object). ``uniform`` for the full cache.
    budgets_file, adaptive_alpha, ragged
        ``calibrated``'s budget file; ``adaptive``'s floor share (default 0.2); whether each head holds only what
        it keeps (default True; False pads every head to the widest). Each is stored as None under an
        allocation it does not apply to, and refused there when given (:data:`ALLOCATION_SETTINGS`)."""

    policy: Policy = field(hash=False)
    budget: int | None = None
    buffer: int = DEFAULT_BUFFER
    quantized: int = 0
    bits: int | None = None
    group_size: int | None = None
    seed: int | tuple[int, ...] = 0
    allocation: str = Uniform.name
    budgets_file: str | None = None
    adaptive_alpha: float | None = None
    ragged: bool | None = None

    def __post_init__(self) -> None:
        # A name is looked up (refused with the valid names if unknown); an instance is taken as given, checked.
        policy = self.policy if isinstance(self.policy, Policy) else get_policy(self.policy)
        check_fields(policy)
        check_sizes(self.budget, self.buffer)
        check_settings(self.quantized, self.bits, self.group_size)
        # The full cache evicts nothing: no budget. A selection policy's budget is what a decode step reads.
        budget = self.budget if policy.evicts or policy.selects else None
        if policy.evicts and budget is None:
            raise ValueError(f"policy {policy.name!r} needs a budget (it evicts)")
        if policy.selects:
            if budget is None:
                raise ValueError(f"policy {policy.name!r} needs a budget (the tokens a decode step reads per head)")
            if self.quantized:
                raise ValueError(f"policy {policy.name!r} selects (it holds every token): it has no quantized tier")
            blocks_per_step(budget, policy.block_size)
        if self.quantized and not type(policy).can_rank():
            raise ValueError(
                f"policy {policy.name!r} does not rank tokens, so it cannot fill a quantized tier "
                f"(quantized={self.quantized}): use an evicting policy that scores or ranks them, or quantized=0"
            )
        rule = self._allocation(policy, budget)
        # stored only under the allocation they apply to (with their defaults), so that a copy (replace) is valid
        own = rule.options()
        ragged = (True if self.ragged is None else self.ragged) if "ragged" in rule.settings else None
        for name, value in (
            ("allocation", rule.name),
            ("budgets_file", own.get("budgets_file")),
            ("adaptive_alpha", own.get("adaptive_alpha")),
            ("ragged", ragged),
            ("policy", policy),
            ("budget", budget),
            ("bits", (8 if self.bits is None else self.bits) if self.quantized else None),
            ("seed", _seed(self.seed)),
        ):
            object.__setattr__(self, name, value)
        reserved = policy.sinks + policy.window
        if budget is not None and not policy.selects and reserved > self.room:
            raise ValueError(
                f"{policy.name}: sinks ({policy.sinks}) + window ({policy.window}) = {reserved} protected tokens "
                f"exceed {self.describe_room()}"
            )

    def _allocation(self, policy: Policy, budget: int | None) -> Allocation:
        """The allocation, checked (a budget file read and checked too); ``uniform`` for the full cache."""
        check_allocation_settings(
            self.allocation, budgets_file=self.budgets_file, adaptive_alpha=self.adaptive_alpha, ragged=self.ragged
        )
        if budget is None:
            return Uniform()
        rule = allocation_rule(self.allocation, budgets_file=self.budgets_file, adaptive_alpha=self.adaptive_alpha)
        if rule.per_head and policy.selects:
            raise ValueError(
                f"allocation={self.allocation!r} applies to evicting policies, not to {policy.name!r} (it selects: "
                "every token held, no budget to share among heads)"
            )
        if rule.per_head and self.quantized:
            raise ValueError(
                f"allocation={self.allocation!r} cannot be combined with a quantized tier "
                f"(quantized={self.quantized}): use allocation='uniform' or quantized=0"
            )
        shared = policy.layers_share_kept_set()
        if rule.per_head and shared is not None:
            raise ValueError(
                f"allocation={self.allocation!r} gives each layer its own budget, but {policy.name!r} with {shared}"
            )
        rule.check(budget, policy.sinks + policy.window)
        return rule

    @classmethod
    def build(
        cls, policy: str | Policy = "full", budget: int | None = None, buffer: int = DEFAULT_BUFFER, **settings: Any
    ) -> CacheSpec:
        """A spec from the keyword API: ``settings`` are its other fields (``quantized``, ``seed``, ``allocation``,
        ...) and the policy's hyper-parameters (``sinks=8``)."""
        own = {name: settings.pop(name) for name in _FIELDS if name in settings}
        return cls(get_policy(policy, **settings), budget, buffer, **own)

    # ------------------------------------------------------------------ derived
    @property
    def evicts(self) -> bool:
        return self.policy.evicts

    @property
    def selects(self) -> bool:
        """A selection policy: the cache holds every token and ``budget`` is what a decode step reads."""
        return self.policy.selects

    @property
    def stored_budget(self) -> int | None:
        """The budget the storage evicts to: None (never) for a selection policy."""
        return None if self.policy.selects else self.budget

    @property
    def trigger(self) -> int | None:
        """``K + B``: the full-precision tokens at which a row is evicted (None: never)."""
        return None if self.stored_budget is None else self.budget + self.buffer

    @property
    def room(self) -> int:
        """Tokens a row keeps after an eviction, both tiers together (``K + Q``)."""
        return (self.budget or 0) + self.quantized

    @property
    def tier(self) -> dict[str, int | None] | None:
        """The quantized tier's settings (``quantized``, ``bits``, ``group_size``), or None without one."""
        if not self.quantized:
            return None
        return {"quantized": self.quantized, "bits": self.bits, "group_size": self.group_size}

    @cached_property
    def allocation_rule(self) -> Allocation:
        """The allocation (:mod:`reasonkv.cache.allocation.rules`) with its settings: what the cache asks of it."""
        return allocation_rule(self.allocation, budgets_file=self.budgets_file, adaptive_alpha=self.adaptive_alpha)

    @property
    def allocated(self) -> bool:
        """Whether heads may keep different numbers of tokens (any allocation but ``uniform``)."""
        return allocation_class(self.allocation).per_head

    def budget_table(self, layers: int, kv_heads: int, length: int | None = None, held: int | None = None):
        """``[layers, kv_heads]`` tokens each evicting layer's heads keep (``adaptive``: its starting split), summing
        to ``K x layers x kv_heads``; ``length``, ``held``: a row's tokens seen and its fullest head (``pyramid``)."""
        if self.budget is None:
            raise ValueError("the full cache has no budget to allocate")
        protected = self.policy.sinks + self.policy.window
        return self.allocation_rule.table(self.budget, layers, kv_heads, protected, length, held)

    def check_compile(self) -> None:
        """``ValueError`` unless a compiled decode step decodes this cache as an eager one does (a cache without a
        fixed-shape layout is not refused: its steps run eagerly and say why)."""
        if self.selects:
            raise ValueError(
                f"policy {self.policy.name!r} chooses the blocks a decode step reads inside the eager attention "
                "kernel, which a compiled step does not call (it would read every token held): decode it "
                "without compile"
            )

    def describe_room(self) -> str:
        if not self.quantized:
            return f"the budget {self.budget}"
        return f"the budget K + Q = {self.budget} + {self.quantized} = {self.room}"

    def replace(self, **changes: Any) -> CacheSpec:
        """A copy with ``changes``, validated again. An allocation setting this spec holds goes over to the copy only
        where it applies there; given again in ``changes``, it is checked as given."""
        rule = allocation_class(changes.get("allocation", self.allocation))
        for name in ALLOCATION_SETTINGS:
            if name not in changes and name not in rule.settings:
                changes[name] = None
        return dataclasses.replace(self, **changes)

    def new_policy(self) -> Policy:
        """A fresh copy of the policy: its generation state belongs to one cache."""
        return get_policy(self.policy)


_FIELDS = tuple(f.name for f in dataclasses.fields(CacheSpec))


def resolve_spec(spec: CacheSpec | None, /, **keywords: Any) -> CacheSpec:
    """``spec``, or the :class:`CacheSpec` the keyword API describes (its fields, ``None`` and ``quantized=0``
    meaning "not given", and the policy's options), never both."""
    given = {
        k: v for k, v in keywords.items() if k not in _FIELDS or (v is not None and not (k == "quantized" and v == 0))
    }
    if spec is None:
        return CacheSpec.build(**given)
    if not isinstance(spec, CacheSpec):
        raise ValueError(f"spec must be a reasonkv.cache.CacheSpec or None, got {spec!r}")
    if given:
        raise ValueError(f"the cache's settings come from spec=...; do not also pass {', '.join(sorted(given))}")
    return spec
