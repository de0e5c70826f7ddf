"""``EvictingCache``: the storage (:class:`~reasonkv.cache.storage.KVStorage`) and the evictor
(:class:`~reasonkv.cache.evictor.Evictor`, or :class:`~reasonkv.cache.selecting.Selecting` for a selection
policy) built from one :class:`~reasonkv.cache.spec.CacheSpec`, attached on construction, ``reset`` between
generations, ``detach`` (or the ``with`` block's end) when done."""

from __future__ import annotations

from reasonkv.cache.evictor import Evictor
from reasonkv.cache.selecting import Selecting
from reasonkv.cache.spec import DEFAULT_BUFFER, CacheSpec
from reasonkv.cache.storage import KVStorage

__all__ = ["EvictingCache"]


class EvictingCache(KVStorage):
    """A transformers ``Cache`` that holds at most ``budget + buffer`` tokens per head.

    Parameters
    ----------
    budget, buffer
        ``K`` (None: never evict) and ``B``: a row is due once it holds ``K + B`` tokens, and is shrunk to ``K``.
    model, policy, seed, policy_kwargs
        With a ``model`` (and a policy name or instance, default ``full``) the cache attaches an
        :class:`~reasonkv.cache.evictor.Evictor`, so ``model.generate(..., past_key_values=cache)`` (``cache=`` on
        newer transformers) evicts on its own; :meth:`detach` (or the ``with`` block's end) removes the hooks. A
        cache with a budget refuses a forward it cannot evict in (no ``model=``, another model, detached).
    num_layers
        Decoder layers known up front, without a model (otherwise created on first use; with a model, its
        full-attention layers evict and the others keep their model's own cache layers).
    sync_timing
        Time the eviction phases exactly on CUDA (events read once per step), for benchmarks.
    quantized, bits, group_size
        A quantized tier of ``Q`` tokens per head (see :class:`~reasonkv.cache.spec.CacheSpec`).
    spec
        The settings above but ``model``, ``num_layers``, ``sync_timing`` as one :class:`~reasonkv.cache.CacheSpec`.

    One cache holds one generation: a second ``model.generate`` on a filled cache is refused; :meth:`reset` first."""

    def __init__(
        self,
        budget: int | None = None,
        buffer: int = DEFAULT_BUFFER,
        *,
        model=None,
        policy=None,
        seed: int | list[int] = 0,
        num_layers: int | None = None,
        sync_timing: bool = False,
        quantized: int = 0,
        bits: int | None = None,
        group_size: int | None = None,
        spec: CacheSpec | None = None,
        **policy_kwargs,
    ):
        tier = dict(quantized=quantized, bits=bits, group_size=group_size)
        if spec is not None:
            given = budget is not None or buffer != DEFAULT_BUFFER or policy is not None or seed != 0
            if given or quantized or bits is not None or group_size is not None or policy_kwargs:
                raise ValueError("pass the cache's settings either as spec=... or as keywords, not both")
            if model is None:
                raise ValueError("a CacheSpec holds a policy, which needs the model: pass model=... too")
        elif model is not None:
            spec = CacheSpec.build(
                "full" if policy is None else policy, budget, buffer, seed=seed, **tier, **policy_kwargs
            )
        elif policy is not None or policy_kwargs:
            raise ValueError("a policy needs the model: pass model=... to EvictingCache")
        self.spec = spec  # None: storage only, nothing attached
        if spec is None:
            super().__init__(budget, buffer, **tier, num_layers=num_layers)
        else:
            super().__init__(spec.stored_budget, spec.buffer, **(spec.tier or {}), model=model)
        hooks = Selecting if spec is not None and spec.selects else Evictor  # a selection policy evicts nothing
        self.evictor = None if spec is None else hooks(model, self, spec, sync_timing=sync_timing)

    def reset(self) -> None:
        """Forget the stored generation (storage, positions, policy state): the cache is as new, still attached."""
        self.clear()
        if self.evictor is not None:
            self.evictor.restart()

    def detach(self) -> None:
        """Remove the model hooks installed by ``model=...`` (no-op otherwise)."""
        if self.evictor is not None:
            self.evictor.detach()

    def __enter__(self) -> EvictingCache:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()
