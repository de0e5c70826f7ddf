"""The policy protocol: a dataclass of hyper-parameters, the signals it needs, and a score.

A policy reads an :class:`EvictionView` and returns scores (higher = keep; ranked by :meth:`Policy.ranking`,
the top ``budget`` kept by :meth:`Policy.keep`), or overrides ``ranking`` (protection variants, sampling) or
``keep`` itself; a quantized tier splits the ranking, so a policy that only overrides ``keep`` cannot fill
one (:meth:`Policy.can_rank`). Granularity ``"token"`` scores ``[rows, slots]`` once for every layer and
head; ``"head"`` scores ``[rows, kv_heads, slots]`` one layer at a time. Only the full-attention layers of a
hybrid model are evicted (``ModelInfo.full_layers``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from reasonkv.policies import select
from reasonkv.policies.contract import AttentionChunk, ModelInfo, Needs, Step
from reasonkv.policies.options import check_at_least, check_fields

if TYPE_CHECKING:
    from reasonkv.policies.view import EvictionView

Granularity = Literal["token", "head"]


@dataclass
class Policy:
    """Base class. Subclasses are dataclasses whose fields are their hyper-parameters, each of the type
    its annotation names (checked whenever a policy is made: :func:`~reasonkv.policies.options.check_fields`).

    Parameters
    ----------
    sinks
        The first ``sinks`` logical positions are never evicted (they count against the budget).
    window
        The ``window`` most recent tokens are never evicted.
    protect_prompt
        Never evict prompt tokens (off by default: the budget covers prompt and output).
    """

    name: ClassVar[str] = ""
    granularity: ClassVar[Granularity] = "token"
    summary: ClassVar[str] = ""  # one line for listings
    paper: ClassVar[str] = ""  # where the method comes from
    evicts: ClassVar[bool] = True  # False for the full cache and the selection policies
    # True for a selection policy (reasonkv.policies.selective): the cache holds every token and each decode
    # step reads only the blocks the policy chooses, within the budget.
    selects: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False  # True when the kept set depends on the seed
    # True when feeding n tokens in one forward leaves the policy in the same state as n single steps
    # (lets teacher-forced replays run chunk by chunk between evictions).
    chunk_exact: ClassVar[bool] = False

    sinks: int = 4
    window: int = 0
    protect_prompt: bool = False

    def __post_init__(self) -> None:
        """Type every option from its annotation, then check ranges. A subclass that normalises an
        option (text to a tuple, say) does so before calling this, and checks its own ranges after."""
        check_fields(self)
        check_at_least(self, "sinks", 0)
        check_at_least(self, "window", 0)
        if hasattr(self, "query_window"):  # a policy that scores with its recent queries observes at least one
            check_at_least(self, "query_window", 1)

    # -- what the policy reads ---------------------------------------------------------------
    def needs(self, info: ModelInfo) -> Needs:
        """The signals this policy reads: its ``query_window`` most recent queries where it has that option, none
        by default."""
        return Needs(query_window=getattr(self, "query_window", 0))

    # -- state across a generation -----------------------------------------------------------
    def reset(self, info: ModelInfo, batch: int, device: torch.device) -> None:
        """Start of a generation: drop any state of the previous one."""

    def observe(self, step: Step) -> None:
        """After every forward pass (stateful policies accumulate here)."""

    def observe_attention(self, chunk: AttentionChunk) -> None:
        """Attention owed for ``Needs.attention_last`` / ``attention_sum``, per layer, in the order the
        queries came; always before the eviction that follows them (see :mod:`reasonkv.cache.observe`)."""

    def observe_queries(self, layer: int, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """``Needs.queries``: one forward's post-RoPE queries of a full-attention layer, as its attention
        kernel received them: ``queries [batch, heads, q, head_dim]``, ``positions`` and ``valid`` ``[batch, q]``.
        Called during the forward, layer by layer, before :meth:`observe` sees its step."""

    # -- eviction -------------------------------------------------------------------------------
    def score(self, view: EvictionView) -> torch.Tensor:
        """Scores of the stored slots, higher = keep: ``[rows, slots]`` or ``[rows, kv_heads, slots]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement score() or keep()")

    def ranking(self, view: EvictionView) -> torch.Tensor:
        """Every slot's priority, shaped like the scores: higher is kept first; protected slots hold
        ``select.MUST_KEEP``, padding ``select.NEVER_KEEP``. The default ranks by :meth:`score`."""
        return select.rank_top(self.score(view), valid=view.valid_mask(), protected=view.protected())

    def keep(self, view: EvictionView) -> torch.Tensor:
        """Indices of the slots to keep, ``[rows, budget]`` or ``[rows, kv_heads, budget]``: the top
        ``budget`` of :meth:`ranking`."""
        return select.keep_ranked(self.ranking(view), k=view.budget)

    def signals(self, view: EvictionView) -> dict[str, torch.Tensor]:
        """The per-token signals this policy scored with at this eviction, by name, for an eviction trace
        (:mod:`reasonkv.inspect.trace`) to show; read-only, never needed to evict. Each is shaped like the
        scores (``[rows, slots]`` or ``[rows, kv_heads, slots]``): float (``NaN`` = none) or bool (a set of
        slots). None by default."""
        return {}

    @classmethod
    def can_rank(cls) -> bool:
        """Whether :meth:`ranking` orders the slots the way :meth:`keep` takes them, so that a
        quantized tier can be filled from it: an evicting policy that scores or ranks, and whose
        ``keep`` (if overridden) is not more specific than its ``ranking``."""
        if not cls.evicts:
            return False
        keep_from = next(i for i, c in enumerate(cls.__mro__) if "keep" in c.__dict__)
        ranking_from = next(i for i, c in enumerate(cls.__mro__) if "ranking" in c.__dict__)
        if ranking_from > keep_from:  # a keep met first in the method order is more specific
            return False
        return cls.__mro__[ranking_from] is not Policy or cls.score is not Policy.score

    def layers_share_kept_set(self) -> str | None:
        """Why every layer keeps the same tokens per kv head (one set chosen for all layers), or None when each
        layer chooses its own. A budget allocation gives layers different budgets, so it cannot apply then."""
        return None

    def keep_layers(self, view: EvictionView) -> list[torch.Tensor]:
        """Head granularity: the kept indices of every full-attention layer, ``keep(view.at(layer))`` each.
        A policy may override it to do work for all layers at once (one batched pass, not one per layer)."""
        return [self.keep(view.at(layer)) for layer in view.info.full_layers]

    def ranking_layers(self, view: EvictionView) -> list[torch.Tensor]:
        """Head granularity: the ranking of every full-attention layer (what a quantized tier splits),
        ``ranking(view.at(layer))`` each; a policy that overrides :meth:`keep_layers` overrides this alike."""
        return [self.ranking(view.at(layer)) for layer in view.info.full_layers]

    # -- description ----------------------------------------------------------------------------
    @classmethod
    def options(cls) -> dict[str, object]:
        """Hyper-parameters and their defaults."""
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out

    def config(self) -> dict[str, object]:
        """This instance's name and hyper-parameters (what a results file records)."""
        return {"policy": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
