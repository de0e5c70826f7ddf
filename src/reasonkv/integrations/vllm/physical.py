"""How many tokens a request holds in vLLM's paged cache (its physical length) from the tokens it computed (its
logical length): one rule, reasonkv's own (evict at ``K + B`` down to ``K`` after the forward that got there; a
prompt of ``K + B`` or more once, after its prefill), that the scheduler and the worker both apply.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lengths"]


@dataclass(frozen=True)
class Lengths:
    """The rule for one engine: ``budget`` (K) and ``buffer`` (B)."""

    budget: int
    buffer: int

    @property
    def trigger(self) -> int:
        return self.budget + self.buffer

    def physical(self, logical: int, prompt: int) -> int:
        """Tokens held once ``logical`` tokens of a request whose prompt has ``prompt`` tokens are computed (and
        any eviction they made due has run). A prompt computed in chunks is never evicted part way."""
        start = max(prompt, self.trigger)  # the first eviction: after the prefill, or once K + B are held
        if logical < start:
            return logical
        if self.buffer == 0:
            return self.budget
        return self.budget + (logical - start) % self.buffer

    def evicts_after(self, logical: int, computed: int, prompt: int) -> bool:
        """Whether the forward that takes a request from ``logical`` to ``logical + computed`` tokens ends with an
        eviction (the tokens it held plus the new ones exceed what the rule says it holds after)."""
        return self.physical(logical, prompt) + computed > self.physical(logical + computed, prompt)

    def blocks(self, tokens: int, block_size: int) -> int:
        return -(-tokens // block_size)

    def evictions(self, logical: int, prompt: int) -> int:
        """Evictions a request made by the time ``logical`` tokens are computed: one after a prefill of ``K + B``
        tokens or more, then one whenever a decode step brings it back to ``K + B``."""
        start = max(prompt, self.trigger)
        if logical < start:
            return 0
        every = self.buffer or 1  # B = 0: every token after the first eviction evicts again
        return 1 + (logical - start) // every
