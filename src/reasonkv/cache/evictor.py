"""Wires a policy to a model and an ``EvictingCache``.

Two hooks on the model do everything, so ``reasonkv.generate`` and ``model.generate`` share one path:

- before a forward that uses this cache: announce which incoming tokens are real, give the model
  their logical ``position_ids`` and the slot-space attention mask, start recording;
- after it: hand the recorded step to the policy, then evict every row that reached ``K + B``:
  the owed attention is handed over, the policy scores, ``select`` picks the kept indices, the
  cache gathers. With a quantized tier the policy ranks instead, and ``tiers.split_tiers`` splits
  the ranking into full precision, quantized and dropped.

A compiled decode step (:mod:`reasonkv.generation.compiled`) runs the same three parts the hooks run
(:meth:`Evictor.announce`, :meth:`Evictor.observe`, :meth:`Evictor.finish`) around its graph instead.

A decode step that evicts nothing reads no device value (the cache keeps host-side bounds), so it
costs the host no synchronisation; an eviction costs a fixed few, whatever the batch and the layers,
with a quantized tier too (the tier's sizes are read once for all layers).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from reasonkv.cache.allocation import adaptive_counts, adaptive_floor, keep_counted, static_counts
from reasonkv.cache.observe import Observer
from reasonkv.cache.spec import CacheSpec
from reasonkv.cache.storage import KVStorage
from reasonkv.cache.tiers import split_tiers
from reasonkv.cache.timing import Stopwatch
from reasonkv.hf import KernelReader, LayerMasks, StepCapture, attention_implementation, model_info
from reasonkv.policies import noise, select
from reasonkv.policies.view import EvictionView
from reasonkv.selection.reader import Selector

__all__ = ["Announced", "Evictor"]


@dataclass(frozen=True)
class Announced:
    """A forward the cache was told of: its tokens' positions for RoPE (``[batch, q]``, 0 at padding), the
    same with -1 at padding, which are real, the slot-space attention mask (None: no slot is padding) and
    the bound on positions the policy may see."""

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
        self.model, self.seed = model, spec.seed
        self.needs = self.policy.needs(self.info)
        self.stopwatch = Stopwatch(sync=sync_timing)
        self.observer = Observer(model, cache, self.needs, stopwatch=self.stopwatch)
        self.observer.policy = self.policy
        self.row_seeds: torch.Tensor | None = None  # [batch] int64, set at the first forward
        # Sliding-window layers hold other keys than the evicting ones: one mask per layer type.
        self.masks = LayerMasks(model, cache) if cache.window is not None else None
        self.eviction_count = 0
        # An eviction trace (reasonkv.inspect.trace): told before and after each gather; None costs nothing.
        self._recorder = None
        self._started = False
        # An allocation: the [layers, kv_heads] budgets, and the reader that gives each head its own mask.
        self.budgets: torch.Tensor | None = None
        self.head_reader = None
        if spec.allocated:
            self._allocate(model, cache)
        # A selection policy evicts nothing: it chooses, inside each decode step's attention kernel, what is read.
        self.selector = Selector(self.policy, spec.budget) if self.policy.selects else None
        self.reader = None if self.selector is None else KernelReader(model, self._read, self.info.full_layers)
        self._in_forward = False  # between announce and finish: the model's attention runs on this cache
        me = weakref.ref(self)
        self._hooks = [
            model.register_forward_pre_hook(_weak(me, "_before_forward"), with_kwargs=True),
            model.register_forward_hook(_weak(me, "_after_forward"), with_kwargs=True),
        ]
        # The model holds the hooks; they hold this object only weakly, so dropping the cache frees it.
        weakref.finalize(self, _remove_handles, self._hooks + self.observer.handles)

    @property
    def cache(self) -> KVStorage:
        return self._cache()

    @property
    def recorder(self):
        """The eviction trace recorder, held weakly (it holds the cache it records)."""
        return None if self._recorder is None else self._recorder()

    @recorder.setter
    def recorder(self, recorder) -> None:
        self._recorder = None if recorder is None else weakref.ref(recorder)

    def detach(self) -> None:
        """Remove the hooks from the model, handing the policy any attention still owed (so that its state
        reflects every step), unless a forward pass broke off."""
        if self._started and not self.observer.active:
            self.observer.flush()
        _remove_handles(self._hooks)
        self.observer.detach()
        if self.head_reader is not None:
            self.head_reader.close()
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
        """Record the signals of the forward ``announce`` described (until :meth:`finish`): during it, or,
        for a compiled step that has run, from what it wrote into ``capture``."""
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
        self.observer.reset()
        self.row_seeds = noise.seed_tensor(self.seed, batch, device)
        if self.selector is not None:
            self.selector.reset()
        self._started = True

    def _read(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """A selection policy's read of one layer's attention (see :class:`~reasonkv.selection.reader.Selector`)."""
        cache = self.cache
        if not self._in_forward:  # the same model running with another cache
            return None
        return self.selector.read(layer, query, key, value, cache.layers[layer].positions, cache.rows.step_positions)

    # ------------------------------------------------------------------ an allocation
    def _allocate(self, model, cache: KVStorage) -> None:
        """Heads keep different numbers of tokens: the budget table, the storage's trigger, and a kernel reader
        that masks each head's own padding."""
        info, spec = self.info, self.spec
        if getattr(self.policy, "selects", False):
            raise ValueError(
                f"allocation={spec.allocation!r} applies to evicting policies, not to {self.policy.name!r}"
            )
        implementation = attention_implementation(model)
        if implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"allocation={spec.allocation!r} gives each kv-head its own mask through the sdpa or eager attention "
                f"kernel; this model runs {implementation!r}: load it with attn_implementation='sdpa'"
            )
        self.budgets = spec.budget_table(len(info.full_layers), info.num_kv_heads)
        heads = info.num_kv_heads
        if spec.allocation == "adaptive":
            floor = adaptive_floor(spec.adaptive_alpha, spec.budget)
            first, widest = spec.budget + spec.buffer, spec.budget * heads - (heads - 1) * floor
        else:
            first, widest = int(self.budgets.min()) + spec.buffer, int(self.budgets.max())
        cache.allocate(first, widest, ragged=spec.ragged)
        self.head_reader = KernelReader(model, self._head_masked, info.full_layers)

    def _head_masked(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """The kernel reads this layer's K/V with a mask of each head's own padding (see ``head_mask``)."""
        if not self._in_forward:  # the same model running with another cache
            return None
        return key, value, self.cache.head_mask(layer, query, query.dtype)

    def _allocated_indices(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The slots each head keeps under the allocation, from the policy's ranking: ``[len(rows), kv_heads,
        width]`` per evicting layer, ``-1`` first where a head keeps fewer than the widest (one host read)."""
        cache, view, spec = self.cache, self._view(rows), self.spec
        layers = cache.full_layers
        if self.policy.granularity == "token":  # ranked over the widest head's slots: each head's by position
            ranking, ranked = self.policy.ranking(view), view.token_positions()
            rankings = [_by_position(ranking, ranked, cache.positions(layer).index_select(0, rows)) for layer in layers]
        else:
            rankings = self.policy.ranking_layers(view)
        budgets = self.budgets
        if spec.allocation == "pyramid":  # PyramidKV caps its schedule for a row that has seen few tokens
            seen = cache.next_position.index_select(0, rows.to(cache.next_position.device)).tolist()
            picked = rows.to(cache.valid.device)
            holds = [(cache.positions(layer).index_select(0, picked) >= 0).sum(-1).amax(-1) for layer in layers]
            fullest = torch.stack(holds).amax(0).tolist()
            shape = self.budgets.shape
            tables = [spec.budget_table(*shape, length=n, held=h) for n, h in zip(seen, fullest, strict=True)]
            budgets = torch.stack(tables, dim=1)  # [layers, rows, kv_heads]
        counts = []
        for index, (layer, ranking) in enumerate(zip(layers, rankings, strict=True)):
            held = cache.positions(layer).index_select(0, rows.to(ranking.device)) >= 0  # a head's own padding
            ranking = ranking.masked_fill(~held, select.NEVER_KEEP)
            rankings[index] = ranking
            if spec.allocation == "adaptive":
                heads = ranking.shape[1]
                counts.append(
                    adaptive_counts(ranking, spec.budget * heads, adaptive_floor(spec.adaptive_alpha, spec.budget))
                )
            else:
                counts.append(static_counts(ranking, budgets[index]))
        width = int(torch.stack([c.max() for c in counts]).max())
        return [keep_counted(r, c, width) for r, c in zip(rankings, counts, strict=True)]

    # ------------------------------------------------------------------ eviction
    def evict_due(self) -> None:
        cache = self.cache
        rows = cache.due_rows()
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
            if cache.quantized:
                keep, quantized = self._tiered_indices(rows)
            else:
                keep, quantized = self._kept_indices(rows), None
        recorder = self.recorder
        if recorder is not None:
            recorder.before_gather(self._view(rows))
        with self.stopwatch("gather"):
            cache.compact(rows, keep, quantized)
        if recorder is not None:
            recorder.after_gather()
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
        )
        if self.budgets is not None:  # each layer's policy sees its heads' mean budget
            means = (self.budgets.sum(1) // self.budgets.shape[1]).tolist()
            view.layer_budgets = dict(zip(self.cache.full_layers, means, strict=True))
        return view

    def _kept_indices(self, rows: torch.Tensor) -> list[torch.Tensor]:
        if self.budgets is not None:
            return self._allocated_indices(rows)
        cache, view = self.cache, self._view(rows)
        if self.policy.granularity == "token":
            kept = self.policy.keep(view)
            return [kept.unsqueeze(1).expand(-1, cache.layers[i].keys.shape[1], -1) for i in cache.full_layers]
        return self.policy.keep_layers(view)

    def _tiered_indices(self, rows: torch.Tensor) -> tuple[list[torch.Tensor], tuple[list[torch.Tensor], torch.Tensor]]:
        """Full-precision slots per evicting layer, and the quantized slots per layer with their count per row."""
        cache, view = self.cache, self._view(rows)
        held = cache.quantized_mask().index_select(0, rows.to(cache.valid.device))
        sizes = dict(full=cache.budget, quantized=cache.quantized, width=self._tier_width(rows))
        if self.policy.granularity == "token":
            split = split_tiers(self.policy.ranking(view), held, **sizes)
            heads = [cache.layers[i].keys.shape[1] for i in cache.full_layers]
            full = [split.full.unsqueeze(1).expand(-1, h, -1) for h in heads]
            return full, ([split.quantized.unsqueeze(1).expand(-1, h, -1) for h in heads], split.counts)
        splits = [split_tiers(ranking, held.unsqueeze(1), **sizes) for ranking in self.policy.ranking_layers(view)]
        # Every head of a row holds as many tokens, so every head keeps as many quantized.
        return [s.full for s in splits], ([s.quantized for s in splits], splits[0].counts[:, 0])

    def _tier_width(self, rows: torch.Tensor) -> int:
        """The quantized tier's width after evicting ``rows`` (one host read for every layer): the most tier
        tokens a row holds, each evicted row ``min(Q, its tokens - K)``, the others what they hold."""
        cache = self.cache
        valid = cache.valid
        counts = valid[:, : cache.low_width].sum(-1)
        evicted = (valid.index_select(0, rows).sum(-1) - cache.budget).clamp(0, cache.quantized)
        return int(counts.index_copy(0, rows, evicted).max())


def _by_position(ranking: torch.Tensor, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """A token ranking ``[rows, slots]`` over slots holding ``positions`` (ascending, ``-1`` first) as each head's
    ranking ``[rows, kv_heads, slots]`` over the slots of ``heads`` (its positions): a token the ranked slots do
    not hold ranks as padding."""
    rows, kv_heads, slots = heads.shape
    keys = positions.unsqueeze(1).expand(rows, kv_heads, positions.shape[-1]).contiguous()
    index = torch.searchsorted(keys, heads.contiguous()).clamp(max=positions.shape[-1] - 1)
    found = keys.gather(2, index) == heads
    spread = ranking.unsqueeze(1).expand(rows, kv_heads, -1).gather(2, index)
    return spread.masked_fill(~found | (heads < 0), select.NEVER_KEEP)


def _weak(ref: weakref.ReferenceType, method: str):
    def hook(*args, **kwargs):
        target = ref()
        return None if target is None else getattr(target, method)(*args, **kwargs)

    return hook


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()
