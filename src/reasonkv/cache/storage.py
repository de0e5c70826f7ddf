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

Hybrid models (see :mod:`reasonkv.cache.hybrid`): only the full-attention layers are evicting layers;
sliding-window and linear-attention layers are transformers' own cache layers for them, and the
sliding layers' mask sizes are their own (``window``).

With a quantized tier (``quantized=Q``, :mod:`reasonkv.cache.tiers`) the slots are ``[quantized | full
precision]``: the first ``low_width`` slots of every layer hold the quantized tokens (packed, per
layer in ``layer.quantized``), the rest the full-precision ones (``layer.keys``/``values``). Each
region keeps a row's tokens right-aligned, so a row may have padding in both. The attention kernel
gets the quantized tokens dequantized in front of the full-precision ones (:meth:`EvictingCache.attended`),
built once per layer and forward and not kept, so the cache holds only the packed codes.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reasonkv.cache.hybrid import WindowValidity, check_layer_kinds
from reasonkv.cache.quantize import QuantFormat, default_group_size
from reasonkv.cache.tiers import QuantizedTier, check_settings

__all__ = ["EvictingCache", "kv_bytes_by_kind"]

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
        self.quantized: QuantizedTier | None = None  # the quantized tier, when the cache has one

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        batch, heads, _, dim = key_states.shape
        if self.parent.quantized:
            self.parent.tier_format(dim)  # refuses a group size that does not divide head_dim
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

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as attention sees them: the quantized tier dequantized, then the full tier."""
        if self.quantized is None or self.quantized.width == 0:
            return self.keys, self.values
        keys, values = self.quantized.dequantize()
        return torch.cat([keys, self.keys], dim=2), torch.cat([values, self.values], dim=2)

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
        :class:`~reasonkv.cache.evictor.Evictor` so that ``model.generate(..., past_key_values=cache)``
        (``cache=`` on newer transformers) evicts on its own. Call :meth:`detach` (or use the
        cache as a context manager) when done to remove the model hooks. A cache with a budget
        refuses a forward pass it cannot evict in (no ``model=``, another model, or detached).
    num_layers
        Number of decoder layers, when known up front (layers are otherwise created on first use).
        Ignored with a ``model``, whose layers and their kinds the cache reads: full-attention layers
        evict, sliding-window and linear-attention layers keep their model's own cache layers.
    sync_timing
        Time the eviction phases exactly on CUDA (with events read once per step), for benchmarks.
    quantized
        ``Q``: tokens per (row, layer, kv-head) kept quantized after an eviction, beside the ``K``
        kept at full precision (default 0: no quantized tier). The policy's ranking decides:
        the top ``K`` stay at full precision, the next ``Q`` are kept quantized, the rest are
        evicted; quantized tokens are never promoted back (see :mod:`reasonkv.cache.tiers`). Needs a
        policy that ranks tokens (every evicting policy built in).
    bits
        Code width of the quantized tier: 8 (default) or 4. Only with ``quantized > 0``.
    group_size
        Numbers per scale and zero point (keys: tokens of one channel; values: channels of one
        token); must divide head_dim. Default: 32, or the largest divisor of head_dim below it.
        Only with ``quantized > 0``.

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
        quantized: int = 0,
        bits: int | None = None,
        group_size: int | None = None,
        **policy_kwargs,
    ):
        _check_sizes(budget, buffer)
        check_settings(quantized, bits, group_size)
        self.budget, self.buffer = budget, buffer
        self.quantized = quantized
        self.bits = bits if bits is not None or not quantized else 8
        self.group_size = group_size
        self._format: QuantFormat | None = None
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
            from reasonkv.cache.evictor import Evictor  # the one place storage is handed its wiring

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
        if quantized and self.budget is None:
            raise ValueError(f"a quantized tier (quantized={quantized}) needs a budget: it holds evicted tokens")
        if quantized and model is not None:
            self.tier_format(self.evictor.info.head_dim)

    def _clear(self) -> None:
        self.slots = 0  # stored slots (the same in every layer between forward passes)
        self.seen = 0  # logical tokens seen, padding included (what transformers calls the seq length)
        self.peak_slots = 0
        self._valid: torch.Tensor | None = None  # [batch, capacity] bool
        self.next_position: torch.Tensor | None = None  # [batch] real tokens seen per row
        self.prompt_lengths: torch.Tensor | None = None  # [batch] real prompt tokens per row
        self.row_evictions: torch.Tensor | None = None  # [batch] evictions per row
        # Host-side facts, so that a decode step never reads a device value:
        self.longest = 0  # no row holds more real full-precision tokens than this
        self.low_width = 0  # slots of the quantized tier (the first ones of every evicting layer)
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
            if not self.low_width:
                return layer.positions
            return torch.cat([layer.quantized.positions, layer.positions], dim=2)
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
        """Bytes of K/V storage held (allocated capacity, not just the used slots), all layer kinds and tiers."""
        held = self.kv_bytes_by_kind()
        return held["full"] + held["quantized"] + held["sliding"]

    def kv_bytes_by_kind(self) -> dict[str, int]:
        """Bytes held per layer kind: ``full`` (the evicting layers' allocated full-precision K/V),
        ``quantized`` (their quantized tier: codes, key-group ids, scales and zero points), ``sliding``
        (the window layers' stored K/V) and ``linear`` (recurrent and convolution states)."""
        return kv_bytes_by_kind(self.layers)

    def kv_bytes_by_tier(self) -> dict[str, int]:
        """Bytes the evicting layers hold per tier: ``full`` (full-precision K/V, allocated capacity) and
        ``quantized`` (codes, key-group ids, scales and zero points)."""
        held = self.kv_bytes_by_kind()
        return {"full": held["full"], "quantized": held["quantized"]}

    def quantized_mask(self) -> torch.Tensor:
        """``[batch, slots]``: True where a slot holds a quantized token."""
        return self.valid & (torch.arange(self.slots, device=self._valid.device) < self.low_width)

    def attended(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values ``[batch, kv_heads, slots, head_dim]`` as attention sees them
        (quantized tokens dequantized: a new tensor each call, views of the storage otherwise)."""
        return self.layers[layer_idx].attended()

    def tier_format(self, head_dim: int) -> QuantFormat:
        """The quantized tier's format for this head_dim (``ValueError`` if the group size does not divide it)."""
        if self._format is None:
            size = self.group_size if self.group_size is not None else default_group_size(head_dim)
            fmt = QuantFormat(self.bits, size)
            fmt.check_head_dim(head_dim)
            self._format = fmt
        return self._format

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
        if layer.length + self.low_width == self.slots:  # the first layer of a new forward pass opens the step
            self._open_step(batch, q, key_states.device)
        layer.write(key_states, value_states, self._step_positions)
        return layer.attended()

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
        """Indices of the rows holding ``K + B`` full-precision tokens or more; ``None`` when none is (read
        from the device only when the host-side bound says a row may be due; quantized tokens do not count)."""
        if self.budget is None or self._valid is None or self.longest < self.budget + self.buffer:
            return None
        held = self.valid[:, self.low_width :].sum(-1)
        due = torch.nonzero(held >= self.budget + self.buffer).flatten()
        if due.numel() == 0:
            self.longest = int(held.max())
            return None
        return due

    def until_due(self) -> torch.Tensor:
        """``[batch]``: tokens each row may still take before its eviction is due (``K + B`` minus
        the full-precision tokens it holds; quantized ones do not count)."""
        return self.budget + self.buffer - self.valid[:, self.low_width :].sum(-1)

    def compact(
        self,
        rows: torch.Tensor,
        keep: list[torch.Tensor],
        quantized: tuple[list[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Shrink ``rows`` to the slots in ``keep`` (one ``[len(rows), kv_heads, K]`` tensor per layer).

        Rows not listed keep every real token. Afterwards every row is right-aligned again and the
        slot count is the longest row's length, so no slot is wasted on padding beyond that.
        With a quantized tier, ``quantized`` names the slots the rows keep quantized (as
        :func:`reasonkv.cache.tiers.split_tiers` returns them: one ``[len(rows), kv_heads, m]`` tensor per
        layer, right-aligned, ``-1`` for none, and the count per row), and ``keep`` only
        full-precision slots.
        """
        evicting = len(self.full_layers)
        if len(keep) != evicting:
            raise ValueError(f"need keep indices for all {evicting} full-attention layers, got {len(keep)}")
        if (quantized is not None) != bool(self.quantized):
            raise ValueError("compact takes the quantized slots exactly when the cache has a quantized tier")
        rows = rows.to(self._valid.device)
        width = self.low_width
        if quantized is None:
            low_valid = self.valid[:, :0]
        else:
            low_valid = self._compact_quantized(rows, *quantized)  # reads the full tier before it moves
            keep = [k - width for k in keep]
        full_valid = self._compact_full(rows, keep)
        new_width, total = low_valid.shape[1], low_valid.shape[1] + full_valid.shape[1]
        if total > self._valid.shape[1]:  # rows with differing tier sizes pad both regions
            self._valid = self._valid.new_zeros((self._valid.shape[0], self._grown_capacity(total, 0)))
        self._valid[:, :new_width] = low_valid
        self._valid[:, new_width:total] = full_valid
        self.slots, self.low_width = total, new_width
        self.longest = full_valid.shape[1]
        self.row_evictions[rows] += 1
        self._release_spare_capacity()

    def _compact_full(self, rows: torch.Tensor, keep: list[torch.Tensor]) -> torch.Tensor:
        """Gather the full-precision tier; returns its new ``[batch, slots]`` validity."""
        k = keep[0].shape[-1]
        valid = self.valid[:, self.low_width :]
        slots = valid.shape[1]
        lengths = valid.sum(-1)
        lengths[rows] = k
        new_slots = int(lengths.max())
        # Stable sort puts padding first and real tokens last, in order: the tail is right-aligned.
        order = torch.sort(valid.to(torch.int8), dim=-1, stable=True).indices[:, slots - new_slots :]
        new_valid = valid.gather(1, order)
        new_valid[rows] = torch.arange(new_slots, device=valid.device) >= new_slots - k
        for layer, layer_keep in zip([self.layers[i] for i in self.full_layers], keep, strict=True):
            heads = layer.keys.shape[1]
            index = order.unsqueeze(1).expand(-1, heads, -1).clone()
            index[rows, :, new_slots - k :] = layer_keep.to(index.device)
            index[rows, :, : new_slots - k] = 0
            layer.gather(index, new_valid)
        return new_valid

    def _compact_quantized(self, rows: torch.Tensor, selected: list[torch.Tensor], counts: torch.Tensor):
        """Rebuild every layer's quantized tier: ``rows`` hold ``selected``, the others what they held.
        Returns the tier's new ``[batch, width]`` validity (right-aligned)."""
        width = self.low_width
        held = self.valid[:, :width]
        device = held.device
        per_row = held.sum(-1)
        per_row[rows] = counts.to(device)
        new_width = int(per_row.max())
        slot = torch.arange(new_width, device=device)
        # Rows not evicted keep their quantized slots, re-right-aligned to the new width.
        current = torch.where(held, torch.arange(width, device=device), -1)
        current = torch.cat([current.new_full((current.shape[0], max(new_width - width, 0)), -1), current], 1)
        current = current[:, current.shape[1] - new_width :]
        for layer, chosen in zip([self.layers[i] for i in self.full_layers], selected, strict=True):
            heads = layer.keys.shape[1]
            select = current.unsqueeze(1).expand(-1, heads, -1).clone()
            chosen = chosen.to(device)
            padding = chosen.new_full((*chosen.shape[:2], new_width - chosen.shape[-1]), -1)
            select[rows] = torch.cat([padding, chosen], -1)
            tier = layer.quantized or QuantizedTier.empty(self.tier_format(layer.keys.shape[-1]), layer.keys)
            layer.quantized = tier.rebuild(select, layer.keys, layer.values, layer.positions)
        return slot >= (new_width - per_row).unsqueeze(1)

    def _release_spare_capacity(self) -> None:
        # A long prompt grows the buffers past K + B once; give that memory back after its eviction.
        limit = self.budget + self.buffer
        if self._valid.shape[1] > limit + self.quantized >= self.slots:
            self._valid = self._valid[:, : limit + self.quantized].clone()
        for index in self.full_layers:
            layer = self.layers[index]
            if layer.capacity > limit >= layer.length:
                layer.resize(limit)

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
        tier = f", quantized={self.quantized}, bits={self.bits}" if self.quantized else ""
        return f"EvictingCache(budget={self.budget}, buffer={self.buffer}{tier}, slots={self.slots}, seen={self.seen})"


def kv_bytes_by_kind(layers) -> dict[str, int]:
    """Bytes held per layer kind by cache ``layers``: an ``EvictingCache``'s, or transformers' own
    (whose full-attention layers count as ``full``)."""
    held = {"full": 0, "quantized": 0, "sliding": 0, "linear": 0}
    for layer in layers:
        if isinstance(layer, _EvictingLayer):
            if layer.is_initialized:
                held["full"] += _tensor_bytes(layer._keys, layer._values)
            if layer.quantized is not None:
                held["quantized"] += layer.quantized.nbytes()
            continue
        kind = _native_kind(layer)
        if kind == "linear":
            states = [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
            held["linear"] += _tensor_bytes(*states)
        else:
            held[kind] += _tensor_bytes(getattr(layer, "keys", None), getattr(layer, "values", None))
    return held


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
