"""Ragged storage: each kv-head of a row holds only what it keeps, in one flat buffer per layer.

Under an allocation the heads of a layer keep different numbers of tokens. :class:`RaggedLayer` stores
``keys``/``values`` ``[batch, capacity, head_dim]`` and positions ``[batch, capacity]``: row ``b``'s head ``h``
owns entries ``[begin[b, h], begin[b, h] + room[b, h])``, its first ``count[b, h]`` being its tokens in order.
After an eviction a region holds what its head kept plus ``B``, so no head is padded to the widest; a head
that outgrows its region has every region of the layer laid out again. Reads assemble the dense ``[batch,
kv_heads, slots, head_dim]`` (each head right-aligned, padding at position ``-1``, hidden by
:func:`~reasonkv.cache.allocation.heads.head_mask`), one layer at a time. On a GPU a varlen kernel could read
the regions in place instead."""

from __future__ import annotations

import torch

from reasonkv.cache.layer import EvictingLayer

__all__ = ["RaggedLayer"]


def _assembled(name: str, read) -> property:
    """A layer's ``keys``, ``values`` or ``positions``, assembled by ``read(layer, flat)`` from ``_name``."""

    def get(layer):
        flat = getattr(layer, f"_{name}")
        return None if flat is None else read(layer, flat)

    def refuse(layer, value) -> None:
        if value is not None:
            raise AttributeError(f"a ragged layer's {name} are assembled from its regions")

    return property(get, refuse)


class RaggedLayer(EvictingLayer):
    """An evicting layer whose heads hold different numbers of tokens in one flat buffer (see the module);
    ``every`` (``B``) is the room each head gets beyond what it keeps."""

    def __init__(self, rows, unannounced, tier_format=None, workspace=None, *, every: int = 0):
        self.every = every
        super().__init__(rows, unannounced, tier_format, workspace)
        self.begin: torch.Tensor | None = None  # [batch, kv_heads]: each head's first entry in its row
        self.room: torch.Tensor | None = None  # [batch, kv_heads]: entries each head's region holds
        self.count: torch.Tensor | None = None  # [batch, kv_heads]: entries each head uses (its tokens)
        self.spare = 0  # host-known: the fewest free entries of any head's region
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None  # the dense read's index, until a write

    # The base class sets these as attributes; here they are assembled from the flat buffers.
    keys = _assembled("keys", lambda layer, flat: layer._read(flat))
    values = _assembled("values", lambda layer, flat: layer._read(flat))
    positions = _assembled("positions", lambda layer, flat: layer._read_positions(flat))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        batch, heads, _, dim = key_states.shape
        self._keys = key_states.new_zeros((batch, 0, dim))
        self._values = value_states.new_zeros((batch, 0, value_states.shape[-1]))
        self._positions = torch.full((batch, 0), -1, dtype=torch.long, device=self.device)
        zeros = torch.zeros((batch, heads), dtype=torch.long, device=self.device)
        self.begin, self.room, self.count = zeros, zeros.clone(), zeros.clone()
        self.spare = 0
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        """The slots of the row-level axis (the flat buffers are sized by the regions, not by slots)."""
        return self.length

    @property
    def entries(self) -> int:
        """Entries the flat buffers hold per row (the longest row's regions together)."""
        return 0 if self._keys is None else self._keys.shape[1]

    def held_bytes(self) -> int:
        """Bytes of the flat K/V buffers: every head's region (its tokens and its room for ``B`` more)."""
        return self._keys.numel() * self._keys.element_size() + self._values.numel() * self._values.element_size()

    def _refresh_views(self) -> None:
        self._dense = None

    # ------------------------------------------------------------------ reading
    def _dense_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, kv_heads, slots]``: the flat entry each dense slot reads, and whether it holds a token."""
        if self._dense is None:
            slots = torch.arange(self.length, device=self.device)
            offset = slots - (self.length - self.count).unsqueeze(-1)  # [batch, heads, slots]
            held = offset >= 0
            # A slot a head holds nothing at reads its region's first entry (or the last one, for an empty region
            # at the end); the mask and position -1 hide it.
            index = (self.begin.unsqueeze(-1) + offset.clamp(min=0)).clamp(max=max(self.entries - 1, 0))
            self._dense = (index, held)
        return self._dense

    def _read(self, flat: torch.Tensor) -> torch.Tensor:
        """The dense ``[batch, kv_heads, slots, dim]`` of a flat buffer (a new tensor)."""
        index, _ = self._dense_index()
        batch, heads, slots = index.shape
        first = torch.arange(batch, device=index.device).view(-1, 1, 1) * flat.shape[1]
        rows = flat.reshape(-1, flat.shape[-1]).index_select(0, (first + index).flatten())
        return rows.view(batch, heads, slots, flat.shape[-1])

    def _read_positions(self, flat: torch.Tensor) -> torch.Tensor:
        """The dense ``[batch, kv_heads, slots]`` positions of the flat ones (-1 where a head holds no token)."""
        index, held = self._dense_index()
        batch, heads, slots = index.shape
        return flat.gather(1, index.view(batch, -1)).view(batch, heads, slots).masked_fill(~held, -1)

    def read_rows(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and positions of the dense ``slots`` ``[n, heads, m]`` of ``rows`` (a negative slot reads a
        head's earlier entries, as a dense layer reads before its view; a slot with no token reads position -1)."""
        count = self.count.index_select(0, rows).unsqueeze(-1)
        offset = slots - (self.length - count)  # the entry within the head's tokens
        real = (offset >= 0) & (offset < count)
        at = self.begin.index_select(0, rows).unsqueeze(-1) + offset.clamp(min=0)
        flat = (rows.view(-1, 1, 1) * self.entries + at.clamp(max=max(self.entries - 1, 0))).flatten()
        dim = self._keys.shape[-1]
        keys = self._keys.reshape(-1, dim).index_select(0, flat).view(*slots.shape, dim)
        values = self._values.reshape(-1, self._values.shape[-1]).index_select(0, flat).view(*slots.shape, -1)
        positions = self._positions.reshape(-1).index_select(0, flat).view(slots.shape).masked_fill(~real, -1)
        return keys, values, positions

    # ------------------------------------------------------------------ writing
    # The base class's update() serves: it calls write(), and returns keys and values (no tier under an allocation).
    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> None:
        """Append ``q`` tokens to every head of every row (their positions ``[batch, q]``, -1 at padding)."""
        batch, heads, q, dim = key_states.shape
        if self.spare < q:
            self._grow(q)
        at = self.begin + self.count  # [batch, heads]
        first = torch.arange(batch, device=at.device).view(-1, 1, 1) * self.entries
        flat = (first + at.unsqueeze(-1) + torch.arange(q, device=at.device)).flatten()
        self._keys.view(-1, dim).index_copy_(0, flat, key_states.reshape(-1, dim))
        self._values.view(-1, value_states.shape[-1]).index_copy_(
            0, flat, value_states.reshape(-1, value_states.shape[-1])
        )
        self._positions.view(-1).index_copy_(0, flat, positions.unsqueeze(1).expand(batch, heads, q).reshape(-1))
        self.count = self.count + q
        self.spare -= q
        self.length += q
        self._dense = None

    def _grow(self, q: int) -> None:
        """Lay every region out again with room for ``q`` more tokens and ``B`` (or a quarter) beyond."""
        everything = torch.arange(self.count.shape[0], device=self.device)
        slots = torch.arange(self.length, device=self.device).expand(*self.count.shape, -1)
        kept = self.read_rows(everything, slots) if self.length else None  # the first write: nothing to move
        self._place(everything, kept, self.count.clone(), self.count + (q + max(self.every, self.length // 4)))

    def compact_rows(
        self, rows: torch.Tensor, keep: torch.Tensor, length: int, holes: torch.Tensor | None = None
    ) -> None:
        """``rows`` keep the dense slots ``keep`` ``[n, heads, k]`` (``holes``: entries keeping nothing), each head's
        region laid out again to hold them plus ``B``; other rows untouched; the dense axis becomes ``length`` slots."""
        keys, values, positions = self.read_rows(rows, keep)
        if holes is not None:
            positions = positions.masked_fill(holes, -1)
        real = positions >= 0
        k = keep.shape[-1]
        # A head's tokens run from its first real entry to the end (padding after it, a finished row's, stays).
        first = torch.where(
            real.any(-1), real.to(torch.int8).argmax(-1), torch.full_like(real[..., 0], k, dtype=torch.long)
        )
        counts = k - first
        self.length = length
        self._place(rows, (keys, values, positions), counts, counts + self.every)

    def _place(
        self,
        rows: torch.Tensor,
        kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        counts: torch.Tensor,
        room: torch.Tensor,
    ) -> None:
        """Give ``rows`` regions of ``room`` ``[n, heads]`` entries from entry 0 and write in each the last
        ``counts`` of ``kept`` (dense keys, values, positions); the buffers fit the longest row (two host reads)."""
        begin = room.cumsum(-1) - room
        total = self.room.index_copy(0, rows, room).sum(-1)  # every row's regions, these rows' new ones
        spare = (self.room - self.count).index_copy(0, rows, room - counts)
        entries, fewest = torch.stack([total.max(), spare.min()]).tolist()
        if entries != self.entries:  # the rows' regions start at entry 0: resizing keeps every row's prefix
            keep = min(entries, self.entries)
            for name in ("_keys", "_values", "_positions"):
                old = getattr(self, name)
                new = old.new_full((old.shape[0], entries, *old.shape[2:]), -1 if name == "_positions" else 0)
                new[:, :keep] = old[:, :keep]
                setattr(self, name, new)
        if kept is not None:
            keys, values, positions = kept
            k = positions.shape[-1]
            offset = torch.arange(k, device=counts.device) - (k - counts).unsqueeze(-1)  # [n, heads, k]
            used = offset >= 0
            flat = rows.view(-1, 1, 1) * entries + begin.unsqueeze(-1) + offset
            where = flat[used]
            self._keys.view(-1, keys.shape[-1]).index_copy_(0, where, keys[used])
            self._values.view(-1, values.shape[-1]).index_copy_(0, where, values[used])
            self._positions.view(-1).index_copy_(0, where, positions[used])
        self.begin = self.begin.index_copy(0, rows, begin)
        self.room = self.room.index_copy(0, rows, room)
        self.count = self.count.index_copy(0, rows, counts)
        self.spare = int(fewest)
        self._dense = None

    # ------------------------------------------------------------------ what the base class does not need here
    def resize(self, capacity: int) -> None:
        """Regions are sized per head (see :meth:`compact_rows`); the slot axis needs no buffer."""

    def make_room(self, q: int) -> int:
        raise RuntimeError("a ragged layer writes through update/write, not into fixed buffers")

    def reset(self) -> None:
        self.__init__(self.rows, self.unannounced, self.tier_format, self.workspace, every=self.every)
