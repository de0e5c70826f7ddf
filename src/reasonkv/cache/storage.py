"""The evicting cache's storage: a transformers ``Cache`` of dense per-layer K/V, the logical position
of every slot, the ``K + B`` trigger and the gather. It knows nothing about scores or policies
(:mod:`reasonkv.cache.evictor` decides what to keep; :mod:`reasonkv.cache.evicting` composes the two).

Per evicting layer (:class:`~reasonkv.cache.layer.EvictingLayer`): ``keys``/``values`` ``[batch, kv_heads,
slots, head_dim]`` and ``positions`` ``[batch, kv_heads, slots]`` (``-1``: padding). Slot validity is shared by
every layer and head of a row (:class:`~reasonkv.cache.rows.RowState`), and each row's real tokens are
right-aligned, like a left-padded batch. Masks live in *slot* space, RoPE in *logical* space (the layout is
in docs/design.md). Only full-attention layers evict (:mod:`reasonkv.cache.hybrid`). With a quantized tier
the slots are ``[quantized | full precision]`` (:mod:`reasonkv.cache.quantized_tier`). An eviction rewrites
only the rows it evicts (and rows fed padding after they finished, right-aligned again)."""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from reasonkv.cache.allocation.heads import widest_positions
from reasonkv.cache.hybrid import WindowValidity, check_layer_kinds
from reasonkv.cache.layer import EvictingLayer
from reasonkv.cache.quantize import QuantFormat, default_group_size
from reasonkv.cache.quantized_tier import DequantizeBuffer, QuantizedTier
from reasonkv.cache.ragged import RaggedLayer
from reasonkv.cache.rows import RowState
from reasonkv.cache.spec import DEFAULT_BUFFER, check_sizes
from reasonkv.cache.tiers import check_settings
from reasonkv.hf import model_info, native_cache

__all__ = ["KVStorage", "kv_bytes_by_kind"]


def _of_rows(name: str) -> property:
    """The storage's read-only view of its layers' shared :class:`RowState` attribute ``name``."""
    return property(lambda storage: getattr(storage.rows, name))


class KVStorage(Cache):
    """A transformers ``Cache`` that stores at most ``budget + buffer`` tokens per head between evictions.

    ``budget`` ``K`` (None: never evict) and ``buffer`` ``B``: a row is due once it holds ``K + B`` tokens;
    ``quantized``, ``bits``, ``group_size``: the tier (see :class:`~reasonkv.cache.spec.CacheSpec`); ``model``: whose
    layers the cache holds (full-attention layers evict, the others keep their model's own cache layers);
    ``num_layers``: the decoder layers, when known without a model (otherwise created on first use)."""

    def __init__(
        self,
        budget: int | None,
        buffer: int = DEFAULT_BUFFER,
        *,
        quantized: int = 0,
        bits: int | None = None,
        group_size: int | None = None,
        model=None,
        num_layers: int | None = None,
    ):
        check_sizes(budget, buffer)
        check_settings(quantized, bits, group_size)
        if quantized and budget is None:
            raise ValueError(f"a quantized tier (quantized={quantized}) needs a budget: it holds evicted tokens")
        self.budget, self.buffer = budget, buffer
        self.quantized = quantized
        self.bits = bits if bits is not None or not quantized else 8
        self.group_size = group_size
        self._format: QuantFormat | None = None
        self.rows = RowState(None if budget is None else budget + buffer, slack=buffer)
        self.workspace = DequantizeBuffer()  # the K/V of a layer with a tier, assembled for its attention
        self._after_evictions: dict[str, torch.Tensor] | None = None  # per row: bytes summed after its evictions
        self.window: WindowValidity | None = None  # the sliding-window layers' padding, if any
        self.allocated = False  # heads keep different numbers of tokens (see allocate)
        if model is not None:
            super().__init__(layers=self._layers_of(model))
            if quantized:
                self.tier_format(model_info(model).head_dim)
        elif num_layers is None:
            super().__init__(layer_class_to_replicate=weakly(self._new_layer))
        else:
            super().__init__(layers=[self._new_layer() for _ in range(num_layers)])

    def _new_layer(self) -> EvictingLayer:
        # The layers call back into this storage weakly: the storage owns them, and a cycle would keep its K/V
        # alive until a garbage collection.
        tier = (weakly(self.tier_format), self.workspace) if self.quantized else ()
        return EvictingLayer(self.rows, weakly(self._unannounced), *tier)

    def _layers_of(self, model) -> list:
        """One cache layer per decoder layer: evicting for full attention, the model's own otherwise."""
        info = model_info(model)
        kinds = info.layer_kinds or ("full",) * info.num_layers
        check_layer_kinds(kinds, type(model).__name__)
        if all(kind == "full" for kind in kinds):
            return [self._new_layer() for _ in kinds]
        native = native_cache(model).layers  # transformers' own, for the layers that do not evict
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
        return [self._new_layer() if kind == "full" else layer for kind, layer in zip(kinds, native, strict=True)]

    # ------------------------------------------------------------------ the rows (shared by the layers; see RowState)
    valid = _of_rows("valid")
    slots = _of_rows("slots")
    seen = _of_rows("seen")
    peak_slots = _of_rows("peak_slots")
    next_position = _of_rows("next_position")
    prompt_lengths = _of_rows("prompt_lengths")
    row_evictions = _of_rows("row_evictions")
    low_width = _of_rows("low_width")
    maybe_padded = _of_rows("maybe_padded")
    capacity = _of_rows("capacity")

    # ------------------------------------------------------------------ introspection
    @property
    def full_layers(self) -> list[int]:
        """Indices of the evicting (full-attention) layers; every layer of a plain model."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, EvictingLayer)]

    def positions(self, layer_idx: int) -> torch.Tensor:
        """Logical positions of one layer's stored tokens, ``[batch, kv_heads, slots]`` (-1: padding); a
        sliding-window layer's are its window's, a linear-attention layer raises ``ValueError``."""
        layer = self.layers[layer_idx]
        if isinstance(layer, EvictingLayer):
            if not self.rows.low_width:
                return layer.positions
            return torch.cat([layer.quantized.positions, layer.positions], dim=2)
        if getattr(layer, "is_sliding", False) and self.window is not None and self.window.stored is not None:
            positions = self.window.positions(self.rows.next_position)
            return positions.unsqueeze(1).expand(-1, layer.keys.shape[1], -1)
        raise ValueError(f"layer {layer_idx} ({type(layer).__name__}) holds no per-token positions")

    def row_lengths(self) -> torch.Tensor:
        """Real tokens held per row, ``[batch]``."""
        return self.valid.sum(-1)

    @property
    def evictions(self) -> int:
        """Row evictions so far, summed over the batch."""
        return 0 if self.rows.row_evictions is None else int(self.rows.row_evictions.sum())

    def kv_bytes(self) -> int:
        """Bytes of K/V storage held (allocated capacity, not just the used slots), all layer kinds and tiers."""
        held = self.kv_bytes_by_kind()
        return sum(held[kind] for kind in ("full", "quantized", "sliding"))

    def kv_bytes_by_kind(self) -> dict[str, int]:
        """Bytes held per layer kind (see :func:`kv_bytes_by_kind`)."""
        return kv_bytes_by_kind(self.layers)

    def kv_bytes_by_tier(self) -> dict[str, int]:
        """The evicting layers' bytes per tier, allocated capacity counted: ``full`` and ``quantized``."""
        return {tier: held for tier, held in self.kv_bytes_by_kind().items() if tier in ("full", "quantized")}

    def row_kv_bytes_by_tier(self) -> dict[str, torch.Tensor]:
        """The bytes each row's tokens need in the evicting layers, ``[batch]`` per tier (``full``: each head's own
        tokens, ``quantized``: codes, group ids and statistics of held groups, pending K/V); padding and spare
        capacity not counted."""
        if not self.rows.started:
            full = torch.zeros(0, dtype=torch.long)
        elif self.allocated:  # heads hold different numbers: count each head's own tokens, layer by layer
            full = sum(
                (layer.positions >= 0).sum((1, 2))
                * sum(t.shape[-1] * t.element_size() for t in (layer.keys, layer.values))
                for layer in (self.layers[i] for i in self.full_layers if self.layers[i].is_initialized)
            )
        else:  # every head holds the row's valid slots: one reduction (it runs at every step that counts bytes)
            full = self.rows.full_valid().sum(-1) * self.full_token_kv_bytes()
        quantized = [
            self.layers[i].quantized.row_bytes() for i in self.full_layers if self.layers[i].quantized is not None
        ]
        return {"full": full, "quantized": torch.stack(quantized).sum(0) if quantized else torch.zeros_like(full)}

    def full_token_kv_bytes(self) -> int:
        """Bytes of one full-precision token in every evicting layer and kv-head (0 before the first forward)."""
        layers = [self.layers[i] for i in self.full_layers if self.layers[i].is_initialized]
        return sum(2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size() for layer in layers)

    def steady_kv_bytes(self) -> list[dict[str, float] | None]:
        """Per row: the mean of :meth:`row_kv_bytes_by_tier` right after each of its evictions (``full``,
        ``quantized``: the steady state, ``B`` empty) and ``tokens``, the full-precision tokens per (layer,
        kv-head) those bytes would hold; ``None`` for a row never evicted. Reads the device once."""
        if self._after_evictions is None:
            return [None] * (0 if self.rows.row_evictions is None else self.rows.row_evictions.shape[0])
        counts = self.rows.row_evictions.double()
        held = torch.stack([self._after_evictions["full"], self._after_evictions["quantized"], counts]).tolist()
        per_token = self.full_token_kv_bytes()
        means = [(full / n, quantized / n) if n else None for full, quantized, n in zip(*held, strict=True)]
        return [None if m is None else {"full": m[0], "quantized": m[1], "tokens": sum(m) / per_token} for m in means]

    def quantized_mask(self) -> torch.Tensor:
        """``[batch, slots]``: True where a slot holds a token of the quantized tier (coded or pending)."""
        return self.rows.quantized_mask()

    def coded_positions(self, layer_idx: int) -> torch.Tensor:
        """``[batch, kv_heads, low_width]``: one layer's coded tokens' positions (``-1`` elsewhere: padding, and
        pending tokens, which attention sees at full precision)."""
        tier = self.layers[layer_idx].quantized
        if tier is None or not self.low_width:
            return self.positions(layer_idx)[:, :, :0]
        return tier.positions.masked_fill(~tier.coded_mask(), -1)

    def attended(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values ``[batch, kv_heads, slots, head_dim]`` as attention sees them
        (the tier dequantized: new tensors each call, views of the storage otherwise)."""
        return self.layers[layer_idx].attended()

    def tier_format(self, head_dim: int) -> QuantFormat:
        """The quantized tier's format for ``head_dim`` (``ValueError`` if it cannot hold it or one key group)."""
        if self._format is None:
            size = self.group_size if self.group_size is not None else default_group_size(head_dim)
            fmt = QuantFormat(self.bits, size)
            fmt.check_head_dim(head_dim)
            if self.quantized < size:
                raise ValueError(
                    f"quantized={self.quantized} holds fewer tokens than one key group ({size} tokens, head_dim "
                    f"{head_dim}): its tokens would wait at full precision forever; use quantized >= {size} or a "
                    "smaller group_size"
                )
            self._format = fmt
        return self._format

    # ------------------------------------------------------------------ transformers Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_query_offset(layer_idx) + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        # A sliding-window layer's mask indexes its own slots.
        sliding = self.window is not None and getattr(self.layers[layer_idx], "is_sliding", False)
        return self.window.held_before if sliding else self.slots

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    # ------------------------------------------------------------------ writing
    def reserve(self, tokens: int) -> None:
        """Declare the most tokens a row reaches in this run (prompt + new), so buffers are allocated once
        (an evicting cache needs at most ``max(prompt, K + B)``)."""
        self.rows.reserve(tokens)

    def begin_forward(
        self, batch: int, q: int, incoming: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Announce the next forward: ``q`` tokens per row, ``incoming`` ``[batch, q]`` True where real (None: all).
        Returns the logical positions for RoPE (``[batch, q]``, 0 at padding), the same with -1 at padding, and the
        slot-space attention mask (None when no slot is padding)."""
        announced = self.rows.announce(batch, q, incoming, device)
        if self.window is not None:
            real = torch.ones((batch, q), dtype=torch.bool, device=device) if incoming is None else incoming
            # The window holds a subset of the tokens announced: no padding among those, none in it.
            self.window.announce(real, maybe_padded=self.rows.maybe_padded)
        return announced

    def _unannounced(self, batch: int, q: int, device: torch.device) -> None:
        """A forward wrote without an evictor announcing it: fine for plain storage, refused with a budget."""
        if self.budget is not None:
            raise RuntimeError(
                f"EvictingCache(budget={self.budget}) was used by a forward pass it cannot evict in: it was "
                "built without model=..., for another model, or its `with` block has exited (detach). Build "
                "it with model=<the model that runs it> and keep it attached while generating."
            )
        self.begin_forward(batch, q, None, device)  # storage without eviction: every token is real

    # ------------------------------------------------------------------ allocations
    def allocate(self, first: int, widest: int, *, ragged: bool = True) -> None:
        """Heads keep different numbers of tokens (:mod:`reasonkv.cache.allocation`), at most ``widest``: a row is
        first due at ``first`` tokens, then every ``B``. A head keeping fewer holds padding (position ``-1``) in its
        first slots, hidden by :func:`~reasonkv.cache.allocation.heads.head_mask` and :meth:`key_valid`.
        ``ragged``: each head holds only what it keeps (:class:`~reasonkv.cache.ragged.RaggedLayer`), else dense
        buffers padded to the widest head. Called before the first forward."""
        self.allocated = True
        self.rows.allocate(first, self.buffer, widest)
        if not ragged:
            return
        for index in self.full_layers:
            layer = self.layers[index]
            if layer.is_initialized:
                raise RuntimeError("allocate before the cache's first forward")
            self.layers[index] = RaggedLayer(self.rows, layer.unannounced, every=self.buffer)

    def key_valid(self, layer_idx: int) -> torch.Tensor:
        """Which stored keys are real: ``[batch, slots]``, or ``[batch, kv_heads, slots]`` under an allocation."""
        if not self.allocated:
            return self.valid
        return self.valid.unsqueeze(1) & (self.layers[layer_idx].positions >= 0)

    def widest_positions(self) -> torch.Tensor:
        """``[batch, slots]``: the positions of each row's widest head. Under an allocation a token policy's heads keep
        nested sets, so the widest holds every token some head holds: what such a policy ranks."""
        return widest_positions([self.layers[i].positions for i in self.full_layers])

    def head_counts(self, layer_idx: int) -> torch.Tensor:
        """``[batch, kv_heads]``: the real tokens each head of a layer holds."""
        return (self.layers[layer_idx].positions >= 0).sum(-1)

    # ------------------------------------------------------------------ eviction
    def compact(
        self,
        rows: torch.Tensor,
        keep: list[torch.Tensor],
        quantized: tuple[list[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Shrink ``rows`` (distinct, ascending) to the slots in ``keep`` (one ``[len(rows), kv_heads, K]`` per
        layer, ascending; ``-1`` first where an allocated head keeps fewer). Other rows are not rewritten unless
        they hold padding between tokens; afterwards every row is right-aligned and the slots are the longest
        row's. With a tier, ``quantized`` is :func:`reasonkv.cache.tiers.split_tiers`' slots per layer and count
        per row, and ``keep`` holds only full-precision slots."""
        evicting = len(self.full_layers)
        if len(keep) != evicting:
            raise ValueError(f"need keep indices for all {evicting} full-attention layers, got {len(keep)}")
        if (quantized is not None) != bool(self.quantized):
            raise ValueError("compact takes the quantized slots exactly when the cache has a quantized tier")
        rows = rows.to(self.valid.device)
        width = self.rows.low_width
        if quantized is None:
            low_valid = self.valid[:, :0]
        else:
            low_valid = self._compact_quantized(rows, *quantized)  # reads the full tier before it moves
            keep = [k - width for k in keep]
        full_valid = self._compact_full(rows, keep)
        self.rows.compacted(rows, low_valid, full_valid)
        self._release_spare_capacity()
        self._count_bytes(rows)

    def _compact_full(self, rows: torch.Tensor, keep: list[torch.Tensor]) -> torch.Tensor:
        """Rewrite the full-precision tier of ``rows`` (and of holey rows); returns its new validity."""
        k = keep[0].shape[-1]
        valid = self.rows.full_valid()
        batch, slots = valid.shape
        lengths = valid.sum(-1)
        lengths[rows] = k
        evicted = torch.zeros(batch, dtype=torch.bool, device=valid.device)
        evicted[rows] = True
        holey = self.rows.holey_rows() & ~evicted
        new_slots, any_holey = torch.stack([lengths.max(), holey.any().long()]).tolist()
        new_valid = valid[:, slots - new_slots :].clone()
        new_valid[rows] = torch.arange(new_slots, device=valid.device) >= new_slots - k
        layers = [self.layers[i] for i in self.full_layers]
        for layer, layer_keep in zip(layers, keep, strict=True):
            layer_keep = layer_keep.to(valid.device)
            if self.allocated:  # -1: a head keeping fewer; its slot is read (any will do) and marked padding
                layer.compact_rows(rows, layer_keep.clamp(min=0), new_slots, holes=layer_keep < 0)
                continue
            layer.compact_rows(rows, layer_keep, new_slots)
        if any_holey:  # right-align them: their padding first, then their tokens in order
            again = holey.nonzero().flatten()
            order = torch.sort(valid[again].to(torch.int8), dim=-1, stable=True).indices[:, slots - new_slots :]
            new_valid[again] = valid[again].gather(1, order)
            offset = slots - new_slots  # the views start `offset` slots later now: old slot j is slot j - offset
            for layer in layers:
                index = (order - offset).unsqueeze(1).expand(-1, layer.keys.shape[1], -1)
                layer.compact_rows(again, index, new_slots)
        return new_valid

    def _compact_quantized(self, rows: torch.Tensor, selected: list[torch.Tensor], counts: torch.Tensor):
        """Update every layer's tier for ``rows``; returns the tier's new ``[batch, width]`` validity."""
        width = self.rows.low_width
        held = self.valid[:, :width]
        device = held.device
        new_width = selected[0].shape[-1]
        if not (new_width or width):
            return held
        per_row = held.sum(-1)
        per_row[rows] = counts.to(device)
        layers = [self.layers[i] for i in self.full_layers]
        updates = []
        for layer, chosen in zip(layers, selected, strict=True):
            tier = layer.quantized or QuantizedTier.empty(self.tier_format(layer.keys.shape[-1]), layer.keys)
            updates.append(tier.plan(rows, chosen.to(device), lambda slots, at=layer: at.read_rows(rows, slots)))
            layer.quantized = tier
        # One host read sizes every layer's key-group table.
        tables = torch.stack([update.needed.max() for update in updates]).tolist()
        for layer, update, groups in zip(layers, updates, tables, strict=True):
            layer.quantized = layer.quantized.apply(update, groups)
        slot = torch.arange(new_width, device=device)
        return slot >= (new_width - per_row).unsqueeze(1)

    def _release_spare_capacity(self) -> None:
        # A long prompt grows the buffers past K + B once; give that memory back after its eviction.
        limit = self.rows.limit
        self.rows.release(limit + self.quantized)
        for index in self.full_layers:
            layer = self.layers[index]
            if layer.capacity > limit >= layer.length:
                layer.resize(limit)

    def _count_bytes(self, rows: torch.Tensor) -> None:
        """Add the evicted rows' bytes per tier, right after their eviction, to their sums (on the device)."""
        held = self.row_kv_bytes_by_tier()
        if self._after_evictions is None:
            self._after_evictions = {tier: torch.zeros_like(b, dtype=torch.float64) for tier, b in held.items()}
        for tier, sums in self._after_evictions.items():
            sums[rows] += held[tier][rows].double()

    # ------------------------------------------------------------------ lifetime
    def clear(self) -> None:
        """Forget the stored generation (storage and row state)."""
        for layer in self.layers:
            layer.reset()
        self.rows.clear()
        self._after_evictions = None
        if self.window is not None:  # the same window, nothing stored yet
            self.window = WindowValidity(self.window.window)

    def __repr__(self) -> str:
        tier = f", quantized={self.quantized}, bits={self.bits}" if self.quantized else ""
        name = type(self).__name__
        return f"{name}(budget={self.budget}, buffer={self.buffer}{tier}, slots={self.slots}, seen={self.seen})"


def weakly(method):
    """``method`` (bound) as a function that holds its object weakly (and does nothing once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


def kv_bytes_by_kind(layers) -> dict[str, int]:
    """Bytes held per layer kind by cache ``layers`` (an ``EvictingCache``'s or transformers' own): ``full``,
    ``quantized`` (codes, group ids, scales, zero points), ``sliding`` and ``linear`` (recurrent and conv states)."""
    held = {"full": 0, "quantized": 0, "sliding": 0, "linear": 0}
    for layer in layers:
        if isinstance(layer, EvictingLayer):
            held["full"] += _tensor_bytes(layer._keys, layer._values)  # None before the first forward
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


def _native_kind(layer) -> str:
    """The layer kind of one of transformers' own cache layers."""
    if getattr(layer, "is_sliding", False):
        return "sliding"
    return "linear" if hasattr(layer, "recurrent_states") else "full"


def _tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
