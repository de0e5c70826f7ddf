"""Wires a policy to a model and an ``EvictingCache``.

Two hooks on the model do everything, so ``reasonkv.generate`` and ``model.generate`` share one path:

- before a forward that uses this cache: announce which incoming tokens are real, give the model
  their logical ``position_ids`` and the slot-space attention mask, start recording;
- after it: hand the recorded step to the policy, then evict every row that reached ``K + B``:
  the policy scores, ``select`` picks the kept indices, the cache gathers.
"""

from __future__ import annotations

import weakref

import torch

from reasonkv.hf import LayerMasks, model_info
from reasonkv.observe import Observer
from reasonkv.policies import get_policy
from reasonkv.timing import Stopwatch
from reasonkv.view import EvictionView

__all__ = ["Evictor"]

_SEED_STRIDE = 0x9E3779B1  # decorrelates the streams of consecutive row seeds


def row_generators(seed: int | list[int], batch: int, device: torch.device, salt: int = 0) -> list[torch.Generator]:
    """One generator per row; a row's stream depends only on its own seed, not on the batch."""
    seeds = [seed] * batch if isinstance(seed, int) else list(seed)
    if len(seeds) != batch:
        raise ValueError(f"got {len(seeds)} seeds for a batch of {batch}")
    generators = []
    for s in seeds:
        g = torch.Generator(device=device)
        g.manual_seed((int(s) * _SEED_STRIDE + salt) % (2**63))
        generators.append(g)
    return generators


class Evictor:
    """Observe → score → select → gather, after every forward pass of ``model`` with ``cache``."""

    def __init__(self, model, cache, policy, *, seed: int | list[int] = 0, sync_timing: bool = False, **policy_kwargs):
        # A fresh instance: the policy's generation state belongs to this cache alone.
        self.policy = get_policy(policy, **policy_kwargs)
        self.info = model_info(model)
        if not self.policy.evicts:
            cache.budget = None
        elif cache.budget is None:
            raise ValueError(f"policy {self.policy.name!r} needs a budget (it evicts)")
        else:
            reserved = self.policy.sinks + self.policy.window
            if reserved > cache.budget:
                raise ValueError(
                    f"{self.policy.name}: sinks ({self.policy.sinks}) + window ({self.policy.window}) = "
                    f"{reserved} protected tokens exceed the budget {cache.budget}"
                )
        self.model, self.cache, self.seed = model, cache, seed
        self.needs = self.policy.needs(self.info)
        self.stopwatch = Stopwatch(sync=sync_timing)
        self.observer = Observer(model, cache, self.needs, stopwatch=self.stopwatch)
        # Sliding-window layers hold other keys than the evicting ones: one mask per layer type.
        self.masks = LayerMasks(model, cache) if cache.window is not None else None
        self.generators: list[torch.Generator] = []
        self.eviction_count = 0
        me = weakref.ref(self)
        self._hooks = [
            model.register_forward_pre_hook(_weak(me, "_before_forward"), with_kwargs=True),
            model.register_forward_hook(_weak(me, "_after_forward"), with_kwargs=True),
        ]
        # The model holds the hooks; they hold this object only weakly, so dropping the cache frees it.
        weakref.finalize(self, _remove_handles, self._hooks + self.observer.handles)

    def detach(self) -> None:
        """Remove the hooks from the model."""
        _remove_handles(self._hooks)
        self.observer.detach()

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
        incoming = mask[:, -q:].bool() if mask is not None else torch.ones(batch, q, dtype=torch.bool)
        incoming = incoming.to(tokens.device)
        if self.cache.seen == 0:
            self._start(batch, tokens.device)
        positions = self.cache.announce(incoming)
        kwargs["attention_mask"] = self.masks(incoming, positions) if self.masks else self.cache.mask_for(incoming)
        kwargs["position_ids"] = positions
        self.observer.begin(incoming, positions)
        return args, kwargs

    def _after_forward(self, module, args, kwargs, output):
        if not self._uses_my_cache(kwargs):
            return None
        step = self.observer.end()
        with self.stopwatch("observe"):
            self.policy.observe(step)
        self.evict_due()
        return None

    def _start(self, batch: int, device: torch.device) -> None:
        self.policy.reset(self.info, batch, device)
        self.observer.reset()
        self.generators = row_generators(self.seed, batch, device, salt=1)

    # ------------------------------------------------------------------ eviction
    def evict_due(self) -> None:
        cache = self.cache
        rows = cache.due_rows()
        if rows.numel() == 0:
            return
        if self.policy.protect_prompt:
            longest = int(cache.prompt_lengths[rows].max())
            if longest > cache.budget:
                raise ValueError(
                    f"protect_prompt keeps a prompt of {longest} tokens, more than the budget {cache.budget}"
                )
        with self.stopwatch("score"):
            keep = self._kept_indices(rows)
        with self.stopwatch("gather"):
            cache.compact(rows, keep)
        self.eviction_count += 1

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent per phase so far: record, observe, score, gather."""
        return self.stopwatch.as_dict()

    def _kept_indices(self, rows: torch.Tensor) -> list[torch.Tensor]:
        cache = self.cache
        view = EvictionView(
            cache=cache,
            recorded=self.observer.recorded,
            policy=self.policy,
            rows=rows,
            generators=[self.generators[int(r)] for r in rows],
            info=self.info,
        )
        if self.policy.granularity == "token":
            kept = self.policy.keep(view)
            return [kept.unsqueeze(1).expand(-1, cache.layers[i].keys.shape[1], -1) for i in cache.full_layers]
        return [self.policy.keep(view.at(layer)) for layer in cache.full_layers]


def _weak(ref: weakref.ReferenceType, method: str):
    def hook(*args, **kwargs):
        target = ref()
        return None if target is None else getattr(target, method)(*args, **kwargs)

    return hook


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()
