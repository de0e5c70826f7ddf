"""The state every evicting layer of a cache shares, per row: which slots are real (every head of a row holds
as many tokens), the logical positions the next tokens get, the prompt lengths and the evictions. The
layers write K/V; this object says where and which rows are due. Host-side bounds (``longest``,
``maybe_padded``, the slot counts) let a decode step that evicts nothing read no device value."""

from __future__ import annotations

import math

import torch

__all__ = ["GROWTH", "RowState"]

GROWTH = 1.25  # capacity growth factor when the run's length is not known (never more than 25% spare)


class RowState:
    """Slot validity, logical positions and eviction counts of each row; shared by the evicting layers.

    ``trigger``: ``K + B``, the full-precision tokens at which a row is due (None: never). ``slack``: slots
    beyond it once rows evict at different steps (a ragged batch), so that the other rows move at most once
    every ``slack`` steps (``B`` for the cache)."""

    def __init__(self, trigger: int | None, slack: int = 0):
        self.trigger, self.slack = trigger, slack
        self.expected_tokens: int | None = None  # the most tokens a row can reach, when known (see reserve)
        # Under an allocation (heads keeping different counts): the new tokens between two evictions and the
        # most a head keeps; see allocate.
        self.every: int | None = None
        self.widest: int | None = None
        self.clear()

    def allocate(self, first: int, every: int, widest: int) -> None:
        """Heads keep different numbers of tokens: a row is first due at ``first`` tokens, then whenever ``every``
        (``B``) new tokens followed its last eviction; a head keeps at most ``widest`` (capacity ``widest + B``)."""
        self.trigger, self.every, self.widest = first, every, widest

    def clear(self) -> None:
        """Forget the stored generation."""
        self.slots = 0  # stored slots (the same in every evicting layer between forward passes)
        self.seen = 0  # logical tokens seen, padding included (what transformers calls the seq length)
        self.peak_slots = 0
        self.buffer: torch.Tensor | None = None  # [batch, capacity] bool: True where a slot holds a real token
        self.next_position: torch.Tensor | None = None  # [batch] real tokens seen per row
        self.prompt_lengths: torch.Tensor | None = None  # [batch] real prompt tokens per row
        self.row_evictions: torch.Tensor | None = None  # [batch] evictions per row
        self.longest = 0  # no row holds more real full-precision tokens than this
        self.low_width = 0  # slots of the quantized tier (the first ones of every evicting layer)
        self.maybe_padded = False  # whether a slot may hold padding
        self.ragged = False  # whether some eviction left rows out (then capacity has `slack` slots more)
        self.decoded = False  # whether a single-token step followed the first forward
        self.announced: tuple[int, torch.Tensor] | None = None  # (q, positions [batch, q]) of the next forward
        self.step_positions: torch.Tensor | None = None  # [batch, q] positions of the forward in progress
        self.row_due: torch.Tensor | None = None  # [batch] under an allocation: the tokens at which each row is due
        self.due_bound: int | None = None  # host-side: no row is due below it (under an allocation)

    @property
    def started(self) -> bool:
        return self.buffer is not None

    @property
    def valid(self) -> torch.Tensor:
        """``[batch, slots]``: True where a slot holds a real token (False: padding)."""
        return self.buffer[:, : self.slots]

    @property
    def capacity(self) -> int:
        """Slots allocated per row (what the buffers can hold before they grow)."""
        return 0 if self.buffer is None else self.buffer.shape[1]

    def reserve(self, tokens: int) -> None:
        """The most tokens a row can reach in this run, so that buffers are allocated once."""
        self.expected_tokens = int(tokens)

    def capacity_for(self, needed: int, current: int) -> int:
        """Slots to allocate when ``needed`` exceed the ``current`` capacity: what the run reaches at most
        (``K + B`` once evicting), or 25% more when unknown."""
        limit = self.limit
        if self.expected_tokens is not None:
            most = self.expected_tokens if limit is None else min(self.expected_tokens, limit)
            return max(needed, most)
        if limit is not None:
            return max(needed, limit)
        return max(needed, math.ceil(current * GROWTH))

    @property
    def limit(self) -> int | None:
        """Full-precision slots a layer allocates once evicting: ``K + B``, plus ``slack`` in a ragged batch."""
        if self.trigger is None:
            return None
        most = self.trigger if self.widest is None else self.widest + self.every
        return most + (self.slack if self.ragged else 0)

    # ------------------------------------------------------------------ a forward pass
    def announce(
        self, batch: int, q: int, incoming: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The next forward: see :meth:`~reasonkv.cache.storage.KVStorage.begin_forward`."""
        if self.started and (q < 1 or (incoming is not None and q > 1 and self.decoded)):
            raise ValueError(
                "this EvictingCache already holds a generation: a new generate call would continue from its "
                "evicted state. Call cache.reset() or build a new EvictingCache for each generation."
            )
        if q < 1:
            raise ValueError("a forward with an EvictingCache needs at least one new token")
        if not self.started:
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
        if start + q > self.capacity:
            grown = self.buffer.new_zeros((batch, self.capacity_for(start + q, self.capacity)))
            grown[:, :start] = self.buffer[:, :start]
            self.buffer = grown
        self.buffer[:, start : start + q] = True if incoming is None else incoming
        self.announced = (q, step_positions)
        self.longest += q
        mask = self.buffer[:, : start + q] if self.maybe_padded else None
        return positions, step_positions, mask

    def _start(self, batch: int, q: int, incoming: torch.Tensor | None, device: torch.device) -> None:
        self.buffer = torch.zeros((batch, self.capacity_for(q, 0)), dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.prompt_lengths = (
            torch.full((batch,), q, dtype=torch.long, device=device) if incoming is None else incoming.sum(-1)
        )
        self.row_evictions = torch.zeros(batch, dtype=torch.long, device=device)

    def opens_step(self, layer_length: int) -> bool:
        """Whether a layer holding ``layer_length`` full-precision slots is the first to write this forward."""
        return layer_length + self.low_width == self.slots

    def open_step(self, q: int) -> torch.Tensor:
        """The first layer of a forward writes: count its ``q`` slots; returns their positions ``[batch, q]``."""
        self.step_positions, self.announced = self.announced[1], None
        self.slots += q
        self.seen += q
        self.peak_slots = max(self.peak_slots, self.slots)
        return self.step_positions

    def expects(self, q: int) -> bool:
        """Whether a forward of ``q`` tokens was announced."""
        return self.announced is not None and self.announced[0] == q

    # ------------------------------------------------------------------ eviction
    def full_valid(self) -> torch.Tensor:
        """``[batch, slots - low_width]``: validity of the full-precision tier."""
        return self.valid[:, self.low_width :]

    def due_rows(self) -> torch.Tensor | None:
        """Indices of the rows holding ``K + B`` full-precision tokens or more, or None (the device is read only when
        the host-side bound says a row may be due)."""
        bound = self.trigger if self.due_bound is None else self.due_bound
        if self.trigger is None or not self.started or self.longest < bound:
            return None
        held = self.full_valid().sum(-1)
        due = torch.nonzero(held >= self._due_at()).flatten()
        if due.numel() == 0:
            self.longest = int(held.max())
            return None
        return due

    def until_due(self) -> torch.Tensor:
        """``[batch]``: full-precision tokens each row may still take before it is due."""
        return self._due_at() - self.full_valid().sum(-1)

    def _due_at(self) -> int | torch.Tensor:
        """``K + B``, or each row's under an allocation (the trigger then bounds them all from below)."""
        return self.trigger if self.row_due is None else self.row_due

    def holey_rows(self) -> torch.Tensor:
        """``[batch]``: rows with padding after their first real full-precision slot (fed padding when finished)."""
        valid = self.full_valid()
        first = valid.to(torch.int8).argmax(-1)  # the first real slot (0 for a row of padding only)
        return valid.shape[1] - first > valid.sum(-1)

    def compacted(self, rows: torch.Tensor, low_valid: torch.Tensor, full_valid: torch.Tensor) -> None:
        """After ``rows`` were evicted: the new validity of both tiers (``[batch, width]`` each)."""
        width, total = low_valid.shape[1], low_valid.shape[1] + full_valid.shape[1]
        if total > self.capacity:  # rows with differing tier sizes pad both regions
            self.buffer = self.buffer.new_zeros((self.buffer.shape[0], self.capacity_for(total, 0)))
        self.buffer[:, :width] = low_valid
        self.buffer[:, width:total] = full_valid
        self.slots, self.low_width = total, width
        self.longest = full_valid.shape[1]
        self.row_evictions[rows] += 1
        if self.every is not None:  # due again after `every` new tokens; heads keeping fewer hold padding
            if self.row_due is None:
                self.row_due = torch.full_like(self.row_evictions, self.trigger)
            # Each row from what it holds now (its widest head's tokens), not the batch's slots: a row whose heads
            # keep fewer than another row's would otherwise wait for more than `every` tokens.
            held = full_valid[rows].sum(-1)
            self.row_due[rows] = held + self.every
            # A host-side bound below every row's due count, so that a step before it reads nothing (one host
            # read per eviction).
            again = int(held.min()) + self.every
            if rows.numel() == self.buffer.shape[0]:  # every row was evicted now: all are due at `again`
                self.due_bound = again
            else:  # the others keep theirs
                self.due_bound = min(self.trigger if self.due_bound is None else self.due_bound, again)
            self.maybe_padded = True
        if rows.numel() < self.buffer.shape[0]:  # host-known: this eviction left rows out
            self.ragged = self.maybe_padded = True

    def release(self, limit: int) -> None:
        """Give back capacity beyond ``limit`` slots (a long prompt grew the buffer past ``K + B`` once)."""
        if self.capacity > limit >= self.slots:
            self.buffer = self.buffer[:, :limit].clone()

    def quantized_mask(self) -> torch.Tensor:
        """``[batch, slots]``: True where a slot holds a quantized token."""
        return self.valid & (torch.arange(self.slots, device=self.buffer.device) < self.low_width)
