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

With a quantized tier (``quantized=Q``, :mod:`reasonkv.tiers`) the slots are ``[quantized | full
precision]``: the first ``low_width`` slots of every layer hold the quantized tokens (packed, per
layer in ``layer.quantized``), the rest the full-precision ones (``layer.keys``/``values``). Each
region keeps a row's tokens right-aligned, so a row may have padding in both. The attention kernel
gets the quantized tokens dequantized in front of the full-precision ones (:meth:`EvictingCache.attended`),
built once per layer and forward and not kept, so the cache holds only the packed codes.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reasonkv.quantize import QuantFormat, default_group_size
from reasonkv.tiers import QuantizedTier, check_settings

__all__ = ["EvictingCache"]


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
        Optional: given a ``model`` (and a policy name or instance), the cache attaches an
        :class:`~reasonkv.evictor.Evictor` so that ``model.generate(..., past_key_values=cache)``
        (``cache=`` on newer transformers) evicts on its own. Call :meth:`detach` (or use the
        cache as a context manager) when done to remove the model hooks.
    num_layers
        Number of decoder layers, when known up front (layers are otherwise created on first use).
    sync_timing
        Synchronise CUDA around each timed eviction phase, for an exact split in benchmarks.
    quantized
        ``Q``: tokens per (row, layer, kv-head) kept quantized after an eviction, beside the ``K``
        kept at full precision (default 0: no quantized tier). The policy's ranking decides:
        the top ``K`` stay at full precision, the next ``Q`` are kept quantized, the rest are
        evicted; quantized tokens are never promoted back (see :mod:`reasonkv.tiers`). Needs a
        policy that ranks tokens (every evicting policy built in).
    bits
        Code width of the quantized tier: 8 (default) or 4. Only with ``quantized > 0``.
    group_size
        Numbers per scale and zero point (keys: tokens of one channel; values: channels of one
        token); must divide head_dim. Default: 32, or the largest divisor of head_dim below it.
        Only with ``quantized > 0``.
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
        self.low_width = 0  # slots of the quantized tier (the first ones of every layer)
        self._format: QuantFormat | None = None
        if model is not None and num_layers is None:
            from reasonkv.hf import model_info

            num_layers = model_info(model).num_layers
        if num_layers is None:
            super().__init__(layer_class_to_replicate=partial(_EvictingLayer, self))
        else:
            super().__init__(layers=[_EvictingLayer(self) for _ in range(num_layers)])
        self.slots = 0  # stored slots (the same in every layer between forward passes)
        self.seen = 0  # logical tokens seen, padding included (what transformers calls the seq length)
        self.peak_slots = 0
        self._valid: torch.Tensor | None = None  # [batch, capacity] bool
        self.next_position: torch.Tensor | None = None  # [batch] real tokens seen per row
        self.prompt_lengths: torch.Tensor | None = None  # [batch] real prompt tokens per row
        self.row_evictions: torch.Tensor | None = None  # [batch] evictions per row
        self._incoming: torch.Tensor | None = None  # validity of the next forward's tokens
        self._step_positions: torch.Tensor | None = None  # [batch, q] positions of the open step
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
        if quantized and self.budget is None:
            raise ValueError(f"a quantized tier (quantized={quantized}) needs a budget: it holds evicted tokens")
        if quantized and model is not None:
            self.tier_format(self.evictor.info.head_dim)

    # ------------------------------------------------------------------ introspection
    @property
    def valid(self) -> torch.Tensor:
        """``[batch, slots]``: True where a slot holds a real token (False: padding)."""
        return self._valid[:, : self.slots]

    def positions(self, layer_idx: int) -> torch.Tensor:
        """Logical positions of the stored tokens of one layer, ``[batch, kv_heads, slots]`` (-1: padding)."""
        layer = self.layers[layer_idx]
        if not self.low_width:
            return layer.positions
        return torch.cat([layer.quantized.positions, layer.positions], dim=2)

    def row_lengths(self) -> torch.Tensor:
        """Real tokens held per row, ``[batch]``."""
        return self.valid.sum(-1)

    @property
    def evictions(self) -> int:
        """Row evictions so far, summed over the batch."""
        return 0 if self.row_evictions is None else int(self.row_evictions.sum())

    def kv_bytes(self) -> int:
        """Bytes of K/V storage held (allocated capacity, not just the used slots), both tiers."""
        return sum(self.kv_bytes_by_tier().values())

    def kv_bytes_by_tier(self) -> dict[str, int]:
        """Bytes held per tier: ``full`` (full-precision K/V, allocated capacity) and ``quantized``
        (codes, key-group ids, scales and zero points)."""
        full = quantized = 0
        for layer in self.layers:
            if layer.is_initialized:
                full += layer._keys.numel() * layer._keys.element_size()
                full += layer._values.numel() * layer._values.element_size()
            if layer.quantized is not None:
                quantized += layer.quantized.nbytes()
        return {"full": full, "quantized": quantized}

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
        return self.slots + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.slots

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    # ------------------------------------------------------------------ writing
    def announce(self, incoming_valid: torch.Tensor) -> torch.Tensor:
        """Declare which tokens of the next forward are real (``[batch, q]`` bool).

        Returns their logical positions (``[batch, q]``, 0 for padding), which the caller feeds to
        the model as ``position_ids``. Without an announcement every incoming token counts as real.
        """
        self._incoming = incoming_valid.bool()
        next_position = self.next_position
        if next_position is None:
            next_position = torch.zeros(incoming_valid.shape[0], dtype=torch.long, device=incoming_valid.device)
        positions = next_position.unsqueeze(1) + self._incoming.long().cumsum(1) - 1
        return positions.clamp(min=0)

    def mask_for(self, incoming_valid: torch.Tensor) -> torch.Tensor | None:
        """The 2-D slot-space attention mask for a forward with these incoming tokens (None: no padding)."""
        if self._valid is None:
            return None if bool(incoming_valid.all()) else incoming_valid.long()
        mask = torch.cat([self.valid, incoming_valid.bool()], dim=1)
        return None if bool(mask.all()) else mask.long()

    def _open_step(self, batch: int, q: int, device: torch.device) -> None:
        incoming = self._incoming
        if incoming is None or incoming.shape != (batch, q):
            incoming = torch.ones((batch, q), dtype=torch.bool, device=device)
        self._incoming = None
        if self._valid is None:
            self._valid = torch.zeros((batch, 0), dtype=torch.bool, device=device)
            self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
            self.prompt_lengths = incoming.sum(-1)
            self.row_evictions = torch.zeros(batch, dtype=torch.long, device=device)
        positions = self.next_position.unsqueeze(1) + incoming.long().cumsum(1) - 1
        self._step_positions = positions.masked_fill(~incoming, -1)
        self.next_position = self.next_position + incoming.sum(-1)
        if self.slots + q > self._valid.shape[1]:
            grown = self._valid.new_zeros((batch, self._grown_capacity(self.slots + q, self._valid.shape[1])))
            grown[:, : self.slots] = self.valid
            self._valid = grown
        self._valid[:, self.slots : self.slots + q] = incoming
        self.slots += q
        self.seen += q
        self.peak_slots = max(self.peak_slots, self.slots)

    def _append(self, layer: _EvictingLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        batch, _, q, _ = key_states.shape
        if layer.length + self.low_width == self.slots:  # the first layer of a new forward pass opens the step
            self._open_step(batch, q, key_states.device)
        layer.write(key_states, value_states, self._step_positions)
        return layer.attended()

    def _grown_capacity(self, needed: int, current: int) -> int:
        if self.budget is not None:
            needed = max(needed, self.budget + self.buffer)
        return max(needed, 2 * current)

    # ------------------------------------------------------------------ eviction
    def due_rows(self) -> torch.Tensor:
        """Indices of the rows holding ``K + B`` full-precision tokens or more (empty when nothing is due)."""
        if self.budget is None or self._valid is None:
            return torch.empty(0, dtype=torch.long)
        return torch.nonzero(self.until_due() <= 0).flatten()

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
        :func:`reasonkv.tiers.split_tiers` returns them: one ``[len(rows), kv_heads, m]`` tensor per
        layer, right-aligned, ``-1`` for none, and the count per row), and ``keep`` only
        full-precision slots.
        """
        if len(keep) != len(self.layers):
            raise ValueError(f"need keep indices for all {len(self.layers)} layers, got {len(keep)}")
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
        for layer, layer_keep in zip(self.layers, keep, strict=True):
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
        for layer, chosen in zip(self.layers, selected, strict=True):
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
        for layer in self.layers:
            if layer.capacity > limit >= layer.length:
                layer.resize(limit)

    # ------------------------------------------------------------------ lifetime
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


def _take_slots(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buffer[b, h, index[b, h, i]]`` as ``[batch, heads, n, dim]``: whole head_dim rows picked by one
    ``index_select`` over the flattened slots, many times faster than an element-wise ``gather``."""
    batch, heads, capacity, dim = buffer.shape
    first_slot = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * capacity
    rows = buffer.reshape(batch * heads * capacity, dim).index_select(0, (first_slot + index).flatten())
    return rows.view(batch, heads, index.shape[-1], dim)


def _check_sizes(budget: int | None, buffer: int) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"budget must be a positive integer (or None for no eviction), got {budget!r}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0:
        raise ValueError(f"buffer must be a non-negative integer, got {buffer!r}")
