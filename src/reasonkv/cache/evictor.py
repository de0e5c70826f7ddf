"""Wires a policy to a model and an ``EvictingCache``, with two hooks on the model (so ``reasonkv.generate``
and ``model.generate`` share one path): before a forward on this cache, announce which incoming tokens are
real, give the model their ``position_ids`` and the slot-space mask, start recording; after it, hand the
step to the policy, then evict every row that reached ``K + B`` (owed attention handed over, the policy
ranks or keeps, the cache gathers; with a tier ``tiers.split_tiers`` splits the ranking). A compiled step
(:mod:`reasonkv.generation.compiled`) runs the same three parts (:meth:`Evictor.announce`,
:meth:`Evictor.observe`, :meth:`Evictor.finish`) around its graph.

The one scorer: a listening :class:`~reasonkv.cache.decisions.DecisionLog` only reads each
:class:`~reasonkv.cache.decisions.Decision`. A step that evicts nothing reads no device value; an eviction a
fixed few, whatever the batch, the layers or the tier."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from reasonkv.cache.allocation import keep_counted
from reasonkv.cache.allocation.heads import head_mask
from reasonkv.cache.decisions import Decision, by_position
from reasonkv.cache.observe import Observer
from reasonkv.cache.spec import CacheSpec
from reasonkv.cache.storage import KVStorage, weakly
from reasonkv.cache.tiers import split_tiers
from reasonkv.cache.timing import Stopwatch
from reasonkv.hf import KernelReader, LayerMasks, StepCapture, model_info
from reasonkv.hf.tap import check_readable
from reasonkv.policies import noise, select
from reasonkv.policies.base import Policy
from reasonkv.policies.view import EvictionView

__all__ = ["Announced", "Evictor"]


@dataclass(frozen=True)
class Announced:
    """A forward the cache was told of: RoPE positions (``[batch, q]``, 0 at padding), the same with -1 at padding,
    which tokens are real, the slot-space mask (None: no padding) and the bound on positions the policy may see."""

    positions: torch.Tensor
    step_positions: torch.Tensor
    valid: torch.Tensor
    slot_mask: torch.Tensor | None
    position_bound: int


class Evictor:
    """Observe → score → select → gather, after every forward pass of ``model`` with ``cache``."""

    def __init__(self, model, cache: KVStorage, spec: CacheSpec, *, sync_timing: bool = False):
        self.spec = spec
        self.policy = spec.new_policy()  # a fresh instance: its generation state belongs to this cache alone
        self.info = model_info(model)
        # The cache owns its evictor: a strong reference back would make a cycle that keeps a whole cache's K/V
        # alive until a garbage collection, instead of freeing it when its last user drops it.
        self._cache = weakref.ref(cache)
        self.needs = self.policy.needs(self.info)
        self.stopwatch = Stopwatch(sync=sync_timing)
        self.observer = Observer(model, cache, self.needs, stopwatch=self.stopwatch)
        self.observer.policy = self.policy
        self.row_seeds: torch.Tensor | None = None  # [batch] int64, set at the first forward
        # Sliding-window layers hold other keys than the evicting ones: one mask per layer type.
        self.masks = LayerMasks(model, cache) if cache.window is not None else None
        self.eviction_count = 0
        # The layers that hold tokens, with their kinds: the evicting ones and sliding windows (what a log traces).
        kinds = [(i, self.info.kind(i)) for i in range(self.info.num_layers)]
        self.held_layers = tuple((i, kind) for i, kind in kinds if kind in ("full", "sliding"))
        self.log = None  # a DecisionLog (see listen), handed each decision; None costs nothing
        self._started = False
        # An allocation: the [layers, kv_heads] budgets. The kernel reader of an allocation (each head its own
        # mask) or of a selection policy (the blocks a step reads): see _read.
        self.budgets: torch.Tensor | None = None
        if spec.allocated:
            self._allocate(model, cache)
        reads = spec.allocated or spec.selects
        self.reader = KernelReader(model, self._reader, self.info.full_layers) if reads else None
        self._in_forward = False  # between announce and finish: the model's attention runs on this cache
        self._hooks = [
            model.register_forward_pre_hook(weakly(self._before_forward), with_kwargs=True),
            model.register_forward_hook(weakly(self._after_forward), with_kwargs=True),
        ]
        # The model holds the hooks; they hold this object only weakly, so dropping the cache frees it.
        weakref.finalize(self, _remove_handles, self._hooks + self.observer.handles)

    @property
    def cache(self) -> KVStorage:
        return self._cache()

    def listen(self, log) -> None:
        """Hand every decision to ``log``, a :class:`~reasonkv.cache.decisions.DecisionLog` (None: to nobody)."""
        self.log = log

    def detach(self) -> None:
        """Remove the hooks, handing the policy any attention still owed unless a forward broke off."""
        if self._started and not self.observer.active:
            self.observer.flush()
        _remove_handles(self._hooks)
        self.observer.detach()
        if self.reader is not None:
            self.reader.close()

    def restart(self) -> None:
        """The cache was reset: the next forward starts a new generation."""
        self._started = False

    # ------------------------------------------------------------------ hooks
    def _uses_my_cache(self, kwargs) -> bool:
        return kwargs.get("cache", kwargs.get("past_key_values")) is self.cache

    def _before_forward(self, module, args, kwargs):
        if not self._uses_my_cache(kwargs):
            return None
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = args[0] if args else kwargs["inputs_embeds"]
        batch, q = tokens.shape[:2]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError("EvictingCache builds its own attention mask: pass a 2-D padding mask or none")
        incoming = None if mask is None else mask[:, -q:].to(device=tokens.device, dtype=torch.bool)
        forward = self.announce(batch, q, incoming, tokens.device)
        kwargs["attention_mask"] = (
            self.masks(batch, q, forward.slot_mask, forward.positions) if self.masks else forward.slot_mask
        )
        kwargs["position_ids"] = forward.positions
        self.observe(forward)
        return args, kwargs

    def _after_forward(self, module, args, kwargs, output):
        if not self._uses_my_cache(kwargs):
            return None
        self.finish()
        return None

    # ------------------------------------------------------------------ one forward, in three parts
    # The hooks call these around the model's forward; a compiled decode step
    # (reasonkv.generation.compiled) calls them around its graph, observing only after it has run.
    def announce(self, batch: int, q: int, incoming: torch.Tensor | None, device: torch.device) -> Announced:
        """The next forward feeds ``q`` tokens per row, ``incoming`` ``[batch, q]`` True where real (None: all)."""
        if not self._started:
            self._start(batch, device)
        positions, step_positions, slot_mask = self.cache.begin_forward(batch, q, incoming, device)
        self._in_forward = True
        valid = step_positions >= 0 if incoming is None else incoming
        return Announced(positions, step_positions, valid, slot_mask, position_bound=self.cache.seen + q)

    def observe(self, forward: Announced, capture: StepCapture | None = None) -> None:
        """Record the signals of the announced forward until :meth:`finish`: during it, or, for a compiled step that
        has run, from ``capture``."""
        self.observer.begin(forward.valid, forward.step_positions, forward.position_bound, claim=capture is None)
        if capture is not None:
            self.observer.take_capture(capture)

    def finish(self) -> None:
        """After the forward: hand the policy what it recorded, then evict the rows that are due."""
        self._in_forward = False
        step = self.observer.end()
        with self.stopwatch("observe"):
            self.policy.observe(step)
        self.observer.settle()
        self.evict_due()

    def _start(self, batch: int, device: torch.device) -> None:
        self.policy.reset(self.info, batch, device)
        self.observer.recorded.reset()
        self.row_seeds = noise.seed_tensor(self.spec.seed, batch, device)
        self._started = True

    # ------------------------------------------------------------------ an allocation
    def _allocate(self, model, cache: KVStorage) -> None:
        """Heads keep different numbers of tokens: the budget table, the storage's trigger, and a per-head mask."""
        info, spec = self.info, self.spec
        check_readable(model, f"allocation={spec.allocation!r} gives each kv-head its own mask")
        self.budgets = spec.budget_table(len(info.full_layers), info.num_kv_heads)
        fewest, widest = spec.allocation_rule.extent(self.budgets, spec.budget)
        cache.allocate(fewest + spec.buffer, widest, ragged=spec.ragged)

    def _reader(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, kwargs):
        """What the kernel reads (see _read); None while the same model runs with another cache."""
        return self._read(layer, query, key, value) if self._in_forward else None

    def _read(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """The kernel reads this layer's K/V with a mask of each head's own padding (see ``head_mask``)."""
        return key, value, head_mask(self.cache.layers[layer].positions, query, query.dtype)

    def _allocated_indices(self, rows: torch.Tensor) -> tuple[list[torch.Tensor], None, list[torch.Tensor]]:
        """The slots each head keeps under the allocation, from the policy's ranking (``[len(rows), kv_heads, width]``
        per evicting layer, ``-1`` first where a head keeps fewer; one host read), no tier, and those rankings."""
        rule = self.spec.allocation_rule
        held = self._held_positions(rows)
        rankings = self._head_rankings(self._view(rows), rows, held)
        tables = self._row_budgets(rows, held) if rule.per_length else self.budgets
        counts = rule.counts(rankings, tables, self.spec.budget)
        width = int(torch.stack([c.max() for c in counts]).max())
        return [keep_counted(r, c, width) for r, c in zip(rankings, counts, strict=True)], None, rankings

    def _held_positions(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each evicting layer's positions of ``rows``, ``[len(rows), kv_heads, slots]``."""
        cache = self.cache
        return [cache.positions(i).index_select(0, rows.to(cache.valid.device)) for i in cache.full_layers]

    def _row_budgets(self, rows: torch.Tensor, held: list[torch.Tensor]) -> torch.Tensor:
        """Each row's own table, ``[layers, len(rows), kv_heads]``, from its tokens seen and its fullest head (an
        allocation whose table depends on the row: PyramidKV caps a short sequence's schedule)."""
        cache, spec = self.cache, self.spec
        seen = cache.next_position.index_select(0, rows.to(cache.next_position.device)).tolist()
        fullest = torch.stack([(h >= 0).sum(-1).amax(-1) for h in held]).amax(0).tolist()
        shape = self.budgets.shape
        tables = [spec.budget_table(*shape, length=n, held=h) for n, h in zip(seen, fullest, strict=True)]
        return torch.stack(tables, dim=1)

    def _head_rankings(
        self, view: EvictionView, rows: torch.Tensor, held: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The policy's ranking of every evicting head's own slots, ``[len(rows), kv_heads, slots]`` per layer; under an
        allocation a token ranking is spread over each head's positions (``held``), a head's padding last."""
        token = self.policy.granularity == "token"
        if self.budgets is None:
            return self._every_head(self.policy.ranking(view)) if token else self.policy.ranking_layers(view)
        held = self._held_positions(rows) if held is None else held
        if token:  # ranked over the widest head's slots: each head's by position
            ranking, positions = self.policy.ranking(view), view.token_positions()
            rankings = [by_position(ranking, positions, h, select.NEVER_KEEP) for h in held]
        else:
            rankings = self.policy.ranking_layers(view)
        return [r.masked_fill(h.to(r.device) < 0, select.NEVER_KEEP) for r, h in zip(rankings, held, strict=True)]

    # ------------------------------------------------------------------ eviction
    def evict_due(self) -> None:
        cache = self.cache
        rows = cache.rows.due_rows()
        if rows is None:
            return
        if self.policy.protect_prompt:
            longest = int(cache.prompt_lengths[rows].max())
            if longest > self.spec.room:
                raise ValueError(
                    f"protect_prompt keeps a prompt of {longest} tokens, more than {self.spec.describe_room()}"
                )
        self.observer.flush()  # the attention the policy is owed, before it scores
        with self.stopwatch("score"), select.checks_at_exit():
            keep, quantized, rankings = self._kept_indices(rows)
        log = self.log
        decision = None if log is None else self._decision(rows, rankings)
        with self.stopwatch("gather"):
            cache.compact(rows, keep, quantized)
        if decision is not None:
            log.record(self._settled(decision))
        self.eviction_count += 1

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent per phase so far: record, observe, score, gather."""
        return self.stopwatch.as_dict()

    def _view(self, rows: torch.Tensor) -> EvictionView:
        view = EvictionView(
            cache=self.cache,
            recorded=self.observer.recorded,
            policy=self.policy,
            rows=rows,
            row_seeds=self.row_seeds.index_select(0, rows.to(self.row_seeds.device)),
            info=self.info,
            budget=self.spec.budget,
        )
        if self.budgets is not None:  # each layer's policy sees its heads' mean budget
            means = (self.budgets.sum(1) // self.budgets.shape[1]).tolist()
            view.layer_budgets = dict(zip(self.cache.full_layers, means, strict=True))
        return view

    def _kept_indices(self, rows: torch.Tensor) -> tuple[list, tuple[list, torch.Tensor] | None, list | None]:
        """The full-precision slots each evicting layer keeps, the tier's slots per layer with their count per row
        (None without a tier), and the rankings they came from (None: the policy kept directly)."""
        if self.spec.quantized:
            return self._tiered_indices(rows)
        if self.budgets is not None:
            return self._allocated_indices(rows)
        view = self._view(rows)
        if self.policy.granularity == "token":
            return self._every_head(self.policy.keep(view)), None, None
        return self.policy.keep_layers(view), None, None

    def _tiered_indices(self, rows: torch.Tensor) -> tuple[list, tuple[list, torch.Tensor], list[torch.Tensor]]:
        """Full-precision slots per layer, the tier's slots per layer with their count per row, and the rankings."""
        cache = self.cache
        held = cache.quantized_mask().index_select(0, rows.to(cache.valid.device))
        sizes = dict(full=self.spec.budget, quantized=self.spec.quantized, width=self._tier_width(rows))
        rankings = self._head_rankings(self._view(rows), rows)
        if self.policy.granularity == "token":  # one split, every head alike
            split = split_tiers(rankings[0][:, 0], held, **sizes)
            return self._every_head(split.full), (self._every_head(split.quantized), split.counts), rankings
        splits = [split_tiers(ranking, held.unsqueeze(1), **sizes) for ranking in rankings]
        # Every head of a row holds as many tokens, so every head keeps as many quantized.
        return [s.full for s in splits], ([s.quantized for s in splits], splits[0].counts[:, 0]), rankings

    def _every_head(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """A token-granularity ``[rows, n]`` as every evicting layer's ``[rows, kv_heads, n]``."""
        cache = self.cache
        return [per_token.unsqueeze(1).expand(-1, cache.layers[i].keys.shape[1], -1) for i in cache.full_layers]

    # ------------------------------------------------------------------ what a log is told
    def _decision(self, rows: torch.Tensor, rankings: list[torch.Tensor] | None) -> Decision:
        """What this eviction decided over each evicting head's own slots: the rankings (ranked here only where the
        policy kept without them), what the policy protected, scored and signalled."""
        cache, policy, view = self.cache, self.policy, self._view(rows)
        layers, rows = cache.full_layers, rows.to(cache.valid.device)
        before = torch.stack([cache.positions(i).index_select(0, rows) for i in layers], 1)  # [r, L, H, S]
        shared = policy.granularity == "token" and self.budgets is None

        def over_heads(values: torch.Tensor) -> torch.Tensor:  # a token value [r, S] as each head's [r, L, H, S]
            if shared:
                return values[:, None, None, :].expand(before.shape)
            return by_position(values, view.token_positions().to(values.device), before.to(values.device))

        def per_layer(method) -> torch.Tensor:  # a token value over every head, or each layer's own
            if policy.granularity == "token":
                return over_heads(method(view))
            return torch.stack([method(view.at(i)) for i in layers], 1)

        protected = per_layer(lambda v: v.protected())
        scores = None if type(policy).score is Policy.score else per_layer(lambda v: policy.score(v).float())
        if rankings is None and policy.can_rank():
            rankings = self._head_rankings(view, rows)
        ranking = torch.stack(rankings, 1) if rankings is not None and policy.can_rank() else None
        if policy.granularity == "token":
            signals = {name: over_heads(value) for name, value in policy.signals(view).items()}
        else:
            found = [policy.signals(view.at(i)) for i in layers]
            signals = {name: torch.stack([f[name] for f in found], 1) for name in found[0]}
        return Decision(rows, shared, before, protected, scores, ranking, signals)

    def _settled(self, decision: Decision) -> Decision:
        """``decision`` with what the cache holds after its gather."""
        cache, rows = self.cache, decision.rows
        decision.seen = cache.next_position.index_select(0, rows).tolist()
        decision.after = [cache.positions(i).index_select(0, rows) for i, _ in self.held_layers]
        if self.spec.quantized:  # a tier's slots come first in every evicting layer
            held = cache.quantized_mask().index_select(0, rows)[:, None, :]
            evicting = [p for p, (_, kind) in zip(decision.after, self.held_layers, strict=True) if kind == "full"]
            decision.quantized = [torch.where(held, p[..., : held.shape[-1]], -1) for p in evicting]
        return decision

    def _tier_width(self, rows: torch.Tensor) -> int:
        """The tier's width after evicting ``rows`` (one host read for every layer): the most tier tokens a row holds,
        ``min(Q, tokens - K)`` for an evicted row."""
        cache = self.cache
        valid = cache.valid
        counts = valid[:, : cache.low_width].sum(-1)
        evicted = (valid.index_select(0, rows).sum(-1) - self.spec.budget).clamp(0, self.spec.quantized)
        return int(counts.index_copy(0, rows, evicted).max())


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()
