"""The evicting KV cache: dense per-layer K/V, the logical position of every slot, the K + B trigger.

It stores and gathers; it knows nothing about scores. Deciding *what* to keep is the job of a
policy (``policies/``) turned into indices by ``select.py``; ``evictor.py`` wires the two to a model.

Layout, per layer: ``keys``/``values`` are ``[batch, kv_heads, slots, head_dim]``; ``positions`` is
``[batch, kv_heads, slots]``, the logical position of each stored token (``-1`` for padding).
Slot validity (real token vs padding) is shared by all layers and heads of a row, because every head
of a row always holds the same number of real tokens. Each row keeps its real tokens right-aligned:
padding, when a row holds fewer tokens than the longest one, sits at the left, exactly like the
left padding of a batched prompt, which every attention kernel (SDPA, FlashAttention) handles.

Masks live in *slot space* (query ``i`` of a step sits at slot ``slots + i``), RoPE in *logical
space* (the ``position_ids`` the evictor passes). ``get_seq_length`` reports logical tokens seen,
as transformers' generation utilities expect; ``get_mask_sizes``/``get_query_offset`` report slots.

Hybrid models (see :mod:`reasonkv.hybrid`): only the full-attention layers are evicting layers;
sliding-window and linear-attention layers are transformers' own cache layers for them, and the
sliding layers' mask sizes are their own (``window``).
"""

from __future__ import annotations

import math
from functools import partial

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reasonkv.hybrid import WindowValidity, check_layer_kinds

__all__ = ["EvictingCache"]

GROWTH = 1.25  # capacity growth factor when the run's length is not known (never more than 25% spare)


class _EvictingLayer(CacheLayerMixin):
    """One layer's storage; the shared bookkeeping lives in the parent ``EvictingCache``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, parent: EvictingCache):
        super().__init__()
        self.parent = parent
        self.length = 0  # slots written by this layer (equals parent.slots between forwards)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        batch, heads, _, dim = key_states.shape
        self._keys = key_states.new_empty((batch, heads, 0, dim))
        self._values = value_states.new_empty((batch, heads, 0, value_states.shape[-1]))
        self._positions = torch.empty((batch, heads, 0), dtype=torch.long, device=self.device)
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    def resize(self, capacity: int) -> None:
        """Reallocate the buffers to ``capacity`` slots, keeping the first ``length``."""
        n = self.length
        k, v, p = self._keys, self._values, self._positions
        self._keys = k.new_empty((*k.shape[:2], capacity, k.shape[3]))
        self._values = v.new_empty((*v.shape[:2], capacity, v.shape[3]))
        self._positions = p.new_full((*p.shape[:2], capacity), -1)
        self._keys[:, :, :n] = k[:, :, :n]
        self._values[:, :, :n] = v[:, :, :n]
        self._positions[:, :, :n] = p[:, :, :n]
        self._refresh_views()

    def _refresh_views(self) -> None:
        n = self.length
        self.keys = self._keys[:, :, :n]
        self.values = self._values[:, :, :n]
        self.positions = self._positions[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.parent._append(self, key_states, value_states)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> None:
        start, q = self.length, key_states.shape[2]
        if start + q > self.capacity:
            self.resize(self.parent._grown_capacity(start + q, self.capacity))
        self._keys[:, :, start : start + q] = key_states
        self._values[:, :, start : start + q] = value_states
        self._positions[:, :, start : start + q] = positions.unsqueeze(1)
        self.length = start + q
        self._refresh_views()

    def gather(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep slots ``index`` ``[batch, heads, new_slots]``; where ``valid`` is False, padding."""
        n = index.shape[-1]
        keys, values = _take_slots(self._keys, index), _take_slots(self._values, index)
        positions = self.positions.gather(2, index).masked_fill(~valid.unsqueeze(1), -1)
        self._keys[:, :, :n] = keys
        self._values[:, :, :n] = values
        self._positions[:, :, :n] = positions
        self.length = n
        self._refresh_views()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parent.slots + query_length, 0

    def get_seq_length(self) -> int:
        return self.parent.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.parent)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictingCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("EvictingCache cannot be cropped (assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("EvictingCache does not support expanding a filled cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("EvictingCache does not support selecting batch rows")


class EvictingCache(Cache):
    """A transformers ``Cache`` that holds at most ``budget + buffer`` tokens per head.

    Parameters
    ----------
    budget
        ``K``: tokens per (row, layer, kv-head) that survive an eviction. ``None``: never evict.
    buffer
        ``B``: tokens that may accumulate after an eviction before the next one. A row is due for
        eviction once it holds ``K + B`` tokens, and is then shrunk to exactly ``K``.
    model, policy, seed, policy_kwargs
        Given a ``model`` (and a policy name or instance), the cache attaches an
        :class:`~reasonkv.evictor.Evictor` so that ``model.generate(..., past_key_values=cache)``
        (``cache=`` on newer transformers) evicts on its own. Call :meth:`detach` (or use the
        cache as a context manager) when done to remove the model hooks. A cache with a budget
        refuses a forward pass it cannot evict in (no ``model=``, another model, or detached).
    num_layers
        Number of decoder layers, when known up front (layers are otherwise created on first use).
        Ignored with a ``model``, whose layers and their kinds the cache reads: full-attention layers
        evict, sliding-window and linear-attention layers keep their model's own cache layers.
    sync_timing
        Time the eviction phases exactly on CUDA (with events read once per step), for benchmarks.

    One cache holds one generation. A second ``model.generate`` call on a filled cache is refused
    (it would continue from the evicted state); call :meth:`reset` first, or build a new cache.
    """

    def __init__(
        self,
        budget: int | None,
        buffer: int = 128,
        *,
        model=None,
        policy=None,
        seed: int | list[int] = 0,
        num_layers: int | None = None,
        sync_timing: bool = False,
        **policy_kwargs,
    ):
        _check_sizes(budget, buffer)
        self.budget, self.buffer = budget, buffer
        self.window: WindowValidity | None = None  # the sliding-window layers' padding, if any
        if model is not None:
            super().__init__(layers=self._layers_of(model))
        elif num_layers is None:
            super().__init__(layer_class_to_replicate=partial(_EvictingLayer, self))
        else:
            super().__init__(layers=[_EvictingLayer(self) for _ in range(num_layers)])
        self.expected_tokens: int | None = None  # the most tokens a row can reach, when known (see reserve)
        self._clear()
        self.evictor = None
        if model is not None:
            from reasonkv.evictor import Evictor  # the one place storage is handed its wiring

            self.evictor = Evictor(
                model,
                self,
                policy if policy is not None else "full",
                seed=seed,
                sync_timing=sync_timing,
                **policy_kwargs,
            )
        elif policy is not None or policy_kwargs:
            raise ValueError("a policy needs the model: pass model=... to EvictingCache")

    def _clear(self) -> None:
        self.slots = 0  # stored slots (the same in every layer between forward passes)
        self.seen = 0  # logical tokens seen, padding included (what transformers calls the seq length)
        self.peak_slots = 0
        self._valid: torch.Tensor | None = None  # [batch, capacity] bool
        self.next_position: torch.Tensor | None = None  # [batch] real tokens seen per row
        self.prompt_lengths: torch.Tensor | None = None  # [batch] real prompt tokens per row
        self.row_evictions: torch.Tensor | None = None  # [batch] evictions per row
        # Host-side facts, so that a decode step never reads a device value:
        self.longest = 0  # no row holds more real tokens than this
        self.maybe_padded = False  # whether a slot may hold padding
        self.decoded = False  # whether a single-token step followed the first forward
        self._announced: tuple[int, torch.Tensor] | None = None  # (q, positions [batch, q]) of the next forward
        self._step_positions: torch.Tensor | None = None  # [batch, q] positions of the forward in progress
        if self.window is not None:  # the same window, nothing stored yet
            self.window = WindowValidity(self.window.window)

    def _layers_of(self, model) -> list:
        """One cache layer per decoder layer: evicting for full attention, the model's own otherwise."""
        from reasonkv.hf import model_info, native_cache_layers

        info = model_info(model)
        kinds = info.layer_kinds or ("full",) * info.num_layers
        check_layer_kinds(kinds, type(model).__name__)
        if all(kind == "full" for kind in kinds):
            return [_EvictingLayer(self) for _ in kinds]
        native = native_cache_layers(model)
        windows = set()
        for index, (kind, layer) in enumerate(zip(kinds, native, strict=True)):
            if _native_kind(layer) != kind:
                raise ValueError(
                    f"layer {index} of {type(model).__name__} is {kind!r} by its config but transformers "
                    f"caches it in a {type(layer).__name__}; EvictingCache cannot hold this model"
                )
            if kind == "sliding":
                windows.add(layer.sliding_window)
        if len(windows) > 1:
            raise ValueError(f"{type(model).__name__} has sliding layers with different windows {sorted(windows)}")
        if windows:
            self.window = WindowValidity(int(windows.pop()))
        return [_EvictingLayer(self) if kind == "full" else layer for kind, layer in zip(kinds, native, strict=True)]

    # ------------------------------------------------------------------ introspection
    @property
    def full_layers(self) -> list[int]:
        """Indices of the evicting (full-attention) layers; every layer of a plain model."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, _EvictingLayer)]

    @property
    def valid(self) -> torch.Tensor:
        """``[batch, slots]``: True where a slot holds a real token (False: padding)."""
        return self._valid[:, : self.slots]

    def positions(self, layer_idx: int) -> torch.Tensor:
        """Logical positions of the stored tokens of one layer, ``[batch, kv_heads, slots]`` (-1: padding).

        A sliding-window layer's slots are its window (the same positions in every head); a
        linear-attention layer stores no tokens and raises ``ValueError``.
        """
        layer = self.layers[layer_idx]
        if isinstance(layer, _EvictingLayer):
            return layer.positions
        if getattr(layer, "is_sliding", False) and self.window is not None and self.window.stored is not None:
            positions = self.window.positions(self.next_position)
            return positions.unsqueeze(1).expand(-1, layer.keys.shape[1], -1)
        raise ValueError(f"layer {layer_idx} ({type(layer).__name__}) holds no per-token positions")

    def row_lengths(self) -> torch.Tensor:
        """Real tokens held per row, ``[batch]``."""
        return self.valid.sum(-1)

    @property
    def evictions(self) -> int:
        """Row evictions so far, summed over the batch."""
        return 0 if self.row_evictions is None else int(self.row_evictions.sum())

    @property
    def capacity(self) -> int:
        """Slots allocated per row (what the buffers can hold before they grow)."""
        return 0 if self._valid is None else self._valid.shape[1]

    def kv_bytes(self) -> int:
        """Bytes of K/V storage held (allocated capacity, not just the used slots), all layer kinds."""
        by_kind = self.kv_bytes_by_kind()
        return by_kind["full"] + by_kind["sliding"]

    def kv_bytes_by_kind(self) -> dict[str, int]:
        """Bytes held per layer kind: ``full`` (the evicting layers' allocated K/V), ``sliding`` (the
        window layers' stored K/V) and ``linear`` (recurrent and convolution states)."""
        held = {"full": 0, "sliding": 0, "linear": 0}
        for layer in self.layers:
            if isinstance(layer, _EvictingLayer):
                if layer.is_initialized:
                    held["full"] += layer._keys.numel() * layer._keys.element_size()
                    held["full"] += layer._values.numel() * layer._values.element_size()
            elif getattr(layer, "is_sliding", False):
                held["sliding"] += _tensor_bytes(getattr(layer, "keys", None), getattr(layer, "values", None))
            else:
                states = [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
                held["linear"] += _tensor_bytes(*states)
        return held

    # ------------------------------------------------------------------ transformers Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if self._in_window(layer_idx):
            return self.window.held_before + query_length, 0
        return self.slots + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.window.held_before if self._in_window(layer_idx) else self.slots

    def _in_window(self, layer_idx: int) -> bool:
        """Whether ``layer_idx`` is a sliding-window layer (its mask indexes its own slots)."""
        return self.window is not None and getattr(self.layers[layer_idx], "is_sliding", False)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    # ------------------------------------------------------------------ writing
    def reserve(self, tokens: int) -> None:
        """Declare the most tokens a row can reach in this run (prompt + new tokens), so buffers are
        allocated once at the size the run needs instead of growing (an evicting cache needs at most
        ``max(prompt, K + B)``)."""
        self.expected_tokens = int(tokens)

    def begin_forward(
        self, batch: int, q: int, incoming: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Announce the next forward: ``q`` tokens per row, ``incoming`` ``[batch, q]`` True where real
        (``None``: all real).

        Returns the tokens' logical positions for RoPE (``[batch, q]``, 0 at padding), the same with -1 at
        padding, and the slot-space attention mask for the forward (``None`` when no slot is padding).
        """
        if self._valid is not None and (q < 1 or (incoming is not None and q > 1 and self.decoded)):
            raise ValueError(
                "this EvictingCache already holds a generation: a new generate call would continue from its "
                "evicted state. Call cache.reset() or build a new EvictingCache for each generation."
            )
        if q < 1:
            raise ValueError("a forward with an EvictingCache needs at least one new token")
        if self._valid is None:
            self._start(batch, q, incoming, device)
        elif q == 1:
            self.decoded = True
        if incoming is None:
            positions = self.next_position.unsqueeze(1) + torch.arange(q, device=device)
            self.next_position = self.next_position + q
            step_positions = positions
        else:
            positions = self.next_position.unsqueeze(1) + incoming.long().cumsum(1) - 1
            self.next_position = self.next_position + incoming.sum(-1)
            step_positions = positions.masked_fill(~incoming, -1)
            positions = positions.clamp(min=0)
            # A multi-token forward may hold padding; say so only if it does (one read per such forward).
            self.maybe_padded = self.maybe_padded or (q == 1 or not bool(incoming.all()))
        start = self.slots
        if start + q > self._valid.shape[1]:
            grown = self._valid.new_zeros((batch, self._grown_capacity(start + q, self._valid.shape[1])))
            grown[:, :start] = self._valid[:, :start]
            self._valid = grown
        if incoming is None:
            self._valid[:, start : start + q] = True
        else:
            self._valid[:, start : start + q] = incoming
        if self.window is not None:
            real = torch.ones((batch, q), dtype=torch.bool, device=device) if incoming is None else incoming
            self.window.announce(real)
        self._announced = (q, step_positions)
        self.longest += q
        mask = self._valid[:, : start + q] if self.maybe_padded else None
        return positions, step_positions, mask

    def _start(self, batch: int, q: int, incoming: torch.Tensor | None, device: torch.device) -> None:
        self._valid = torch.zeros((batch, self._grown_capacity(q, 0)), dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.prompt_lengths = (
            torch.full((batch,), q, dtype=torch.long, device=device) if incoming is None else incoming.sum(-1)
        )
        self.row_evictions = torch.zeros(batch, dtype=torch.long, device=device)

    def _append(self, layer: _EvictingLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        batch, _, q, _ = key_states.shape
        if layer.length == self.slots:  # the first layer of a new forward pass opens the step
            self._open_step(batch, q, key_states.device)
        layer.write(key_states, value_states, self._step_positions)
        return layer.keys, layer.values

    def _open_step(self, batch: int, q: int, device: torch.device) -> None:
        if self._announced is None or self._announced[0] != q:
            if self.budget is not None:
                raise RuntimeError(
                    f"EvictingCache(budget={self.budget}) was used by a forward pass it cannot evict in: it was "
                    "built without model=..., for another model, or its `with` block has exited (detach). Build "
                    "it with model=<the model that runs it> and keep it attached while generating."
                )
            self.begin_forward(batch, q, None, device)  # storage without eviction: every token is real
        self._step_positions, self._announced = self._announced[1], None
        self.slots += q
        self.seen += q
        self.peak_slots = max(self.peak_slots, self.slots)

    def _grown_capacity(self, needed: int, current: int) -> int:
        steady = None if self.budget is None else self.budget + self.buffer
        if self.expected_tokens is not None:
            most = self.expected_tokens if steady is None else min(self.expected_tokens, steady)
            return max(needed, most)
        if steady is not None:
            return max(needed, steady)
        return max(needed, math.ceil(current * GROWTH))

    # ------------------------------------------------------------------ eviction
    def due_rows(self) -> torch.Tensor | None:
        """Indices of the rows holding ``K + B`` tokens or more; ``None`` when none is (read from the
        device only when the host-side bound says a row may be due)."""
        if self.budget is None or self._valid is None or self.longest < self.budget + self.buffer:
            return None
        lengths = self.row_lengths()
        due = torch.nonzero(lengths >= self.budget + self.buffer).flatten()
        if due.numel() == 0:
            self.longest = int(lengths.max())
            return None
        return due

    def compact(self, rows: torch.Tensor, keep: list[torch.Tensor]) -> None:
        """Shrink ``rows`` to the slots in ``keep`` (one ``[len(rows), kv_heads, K]`` tensor per layer).

        Rows not listed keep every real token. Afterwards every row is right-aligned again and the
        slot count is the longest row's length, so no slot is wasted on padding beyond that.
        """
        evicting = [self.layers[i] for i in self.full_layers]
        if len(keep) != len(evicting):
            raise ValueError(f"need keep indices for all {len(evicting)} full-attention layers, got {len(keep)}")
        rows = rows.to(self._valid.device)
        k = keep[0].shape[-1]
        valid, slots = self.valid, self.slots
        lengths = valid.sum(-1)
        lengths[rows] = k
        new_slots = int(lengths.max())
        # Stable sort puts padding first and real tokens last, in order: the tail is right-aligned.
        order = torch.sort(valid.to(torch.int8), dim=-1, stable=True).indices[:, slots - new_slots :]
        new_valid = valid.gather(1, order)
        new_valid[rows] = torch.arange(new_slots, device=valid.device) >= new_slots - k
        for layer, layer_keep in zip(evicting, keep, strict=True):
            heads = layer.keys.shape[1]
            index = order.unsqueeze(1).expand(-1, heads, -1).clone()
            index[rows, :, new_slots - k :] = layer_keep.to(index.device)
            index[rows, :, : new_slots - k] = 0
            layer.gather(index, new_valid)
        self._valid[:, :new_slots] = new_valid
        self.slots = new_slots
        self.longest = new_slots
        self.row_evictions[rows] += 1
        self._release_spare_capacity()

    def _release_spare_capacity(self) -> None:
        # A long prompt grows the buffers past K + B once; give that memory back after its eviction.
        limit = self.budget + self.buffer
        if self._valid.shape[1] > limit >= self.slots:
            self._valid = self._valid[:, :limit].clone()
            for index in self.full_layers:
                self.layers[index].resize(limit)

    # ------------------------------------------------------------------ lifetime
    def reset(self) -> None:
        """Forget the stored generation (storage, positions, policy state): the cache is as new, still attached."""
        for layer in self.layers:
            layer.reset()
        self._clear()
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

    def __repr__(self) -> str:
        return f"EvictingCache(budget={self.budget}, buffer={self.buffer}, slots={self.slots}, seen={self.seen})"


def _take_slots(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buffer[b, h, index[b, h, i]]`` as ``[batch, heads, n, dim]``: whole head_dim rows picked by one
    ``index_select`` over the flattened slots, many times faster than an element-wise ``gather``."""
    batch, heads, capacity, dim = buffer.shape
    first_slot = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * capacity
    rows = buffer.reshape(batch * heads * capacity, dim).index_select(0, (first_slot + index).flatten())
    return rows.view(batch, heads, index.shape[-1], dim)


def _native_kind(layer) -> str:
    """The layer kind of one of transformers' own cache layers."""
    if getattr(layer, "is_sliding", False):
        return "sliding"
    return "linear" if hasattr(layer, "recurrent_states") else "full"


def _tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _check_sizes(budget: int | None, buffer: int) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"budget must be a positive integer (or None for no eviction), got {budget!r}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0:
        raise ValueError(f"buffer must be a non-negative integer, got {buffer!r}")
