"""Hybrid models: which layer kinds ``EvictingCache`` holds (torch only). **full** attention layers are evicted
(``K + B``); **sliding**-window layers are transformers' own sliding cache layers (the model's window,
padding included, as without reasonkv); **linear**-attention layers are transformers' own, untouched. A
model without a full-attention layer, or with chunked attention, is refused. :class:`WindowValidity`
remembers which window slots are real, to rebuild their mask and positions at every step."""

from __future__ import annotations

import torch

from reasonkv.suggest.integers import check_int

__all__ = ["WindowValidity", "check_layer_kinds"]

SUPPORTED_KINDS = ("full", "sliding", "linear")


def check_layer_kinds(kinds: tuple[str, ...], model_name: str) -> None:
    """Refuse (``ValueError``, naming the kinds and layers) a model with no full-attention layer or a layer kind
    not in ``SUPPORTED_KINDS``."""
    unsupported = [kind for kind in kinds if kind not in SUPPORTED_KINDS]
    if unsupported:
        raise ValueError(
            f"{model_name} has layers EvictingCache cannot hold ({_describe(kinds, set(unsupported))}); "
            f"supported layer kinds: {', '.join(SUPPORTED_KINDS)}"
        )
    if "full" not in kinds:
        raise ValueError(
            f"{model_name} has no full-attention layer ({_describe(kinds, set(kinds))}): there is nothing for "
            "EvictingCache to evict, its sliding-window and linear layers already bound their memory"
        )


def _describe(kinds: tuple[str, ...], shown: set[str]) -> str:
    """``"sliding: layers [0, 1]; linear: layers [2]"`` for the kinds in ``shown``."""
    layers: dict[str, list[int]] = {}
    for index, kind in enumerate(kinds):
        if kind in shown:
            layers.setdefault(kind, []).append(index)
    return "; ".join(f"{kind}: layers {indices}" for kind, indices in layers.items())


class WindowValidity:
    """Which slots of the sliding-window layers hold real tokens, ``[batch, stored]`` for them all (they share one
    window and see the same forwards). After :meth:`announce`, :attr:`current` is the validity of the keys that
    forward attends over (stored + incoming); the last ``window - 1`` stay stored."""

    def __init__(self, window: int):
        check_int("a sliding window", window, 2)
        self.window = window
        self.stored: torch.Tensor | None = None  # [batch, <= window - 1], what the layers hold between forwards
        self.current: torch.Tensor | None = None  # [batch, held_before + q]: the announced forward's keys
        self.held_before = 0  # slots the layers held when the announced forward started
        self.maybe_padded = False  # host-side: whether the announced forward's keys may hold padding

    def announce(self, incoming: torch.Tensor, *, maybe_padded: bool = True) -> None:
        """The next forward brings ``incoming`` ``[batch, q]`` to every sliding layer; ``maybe_padded`` (host-side):
        whether any token announced so far may be padding."""
        incoming = incoming.bool()
        self.held_before = 0 if self.stored is None else self.stored.shape[1]
        self.current = incoming if self.stored is None else torch.cat([self.stored, incoming.to(self.stored.device)], 1)
        self.stored = self.current[:, -(self.window - 1) :]
        self.maybe_padded = maybe_padded

    def mask(self) -> torch.Tensor | None:
        """The announced forward's 2-D padding mask (None: no padding), decided on the host."""
        return self.current.long() if self.maybe_padded else None

    def positions(self, next_position: torch.Tensor) -> torch.Tensor:
        """Logical positions of the stored slots, ``[batch, stored]`` (-1: padding): each row's newest real slot is
        at ``next_position - 1`` and every real slot before it one lower."""
        valid = self.stored
        after = valid.long().flip(1).cumsum(1).flip(1)  # real slots at or after each slot
        positions = next_position.to(valid.device).unsqueeze(1) - after
        return positions.masked_fill(~valid, -1)
