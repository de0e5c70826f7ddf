"""Hybrid models: which layer kinds ``EvictingCache`` holds, and the bookkeeping of the layers it
leaves to their model's own rules. Torch only.

- **full** attention layers are evicted by the policy (``K + B``);
- **sliding**-window layers are transformers' own sliding cache layers: each keeps the model's
  window of the most recent tokens (``window - 1`` stored, plus the tokens of the forward that
  reads them), exactly what the model does without reasonkv;
- **linear**-attention layers (recurrent / convolution state, no per-token K/V) are transformers'
  own cache layers for them, untouched.

A model without a full-attention layer has nothing to evict and is refused, and so is chunked
attention (a window restarting at chunk boundaries), which transformers masks by chunk index.

The sliding layers store every token of the last ``window - 1`` steps, padding included, as the
model's own cache does. :class:`WindowValidity` remembers which of those slots are real, so their
attention mask and their logical positions can be rebuilt at every step.
"""

from __future__ import annotations

import torch

from reasonkv.suggest.integers import check_int

__all__ = ["WindowValidity", "check_layer_kinds"]

SUPPORTED_KINDS = ("full", "sliding", "linear")


def check_layer_kinds(kinds: tuple[str, ...], model_name: str) -> None:
    """Refuse a model whose layers ``EvictingCache`` cannot hold.

    Raises
    ------
    ValueError
        When no layer is full attention (nothing to evict), or a layer's kind is not one of
        ``SUPPORTED_KINDS``; the message names the kind and the layer indices.
    """
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
    """Which slots of the sliding-window layers hold real tokens (False: padding).

    Every sliding layer of a model shares one window and sees the same forwards, so one ``[batch,
    stored]`` tensor describes them all. :meth:`announce` is called before each forward with its
    incoming tokens; :attr:`current` is then the validity of the keys that forward's sliding layers
    attend over (stored + incoming), and afterwards the last ``window - 1`` of them stay stored.
    """

    def __init__(self, window: int):
        check_int("a sliding window", window, 2)
        self.window = window
        self.stored: torch.Tensor | None = None  # [batch, <= window - 1], what the layers hold between forwards
        self.current: torch.Tensor | None = None  # [batch, held_before + q]: the announced forward's keys
        self.held_before = 0  # slots the layers held when the announced forward started
        self.maybe_padded = False  # host-side: whether the announced forward's keys may hold padding

    @property
    def stored_slots(self) -> int:
        return 0 if self.stored is None else self.stored.shape[1]

    def announce(self, incoming: torch.Tensor, *, maybe_padded: bool = True) -> None:
        """The next forward brings ``incoming`` (``[batch, q]`` bool) to every sliding layer; ``maybe_padded``
        (host-side) says whether any token announced so far, these included, may be padding."""
        incoming = incoming.bool()
        self.held_before = self.stored_slots
        self.current = incoming if self.stored is None else torch.cat([self.stored, incoming.to(self.stored.device)], 1)
        self.stored = self.current[:, -(self.window - 1) :]
        self.maybe_padded = maybe_padded

    def mask(self) -> torch.Tensor | None:
        """The 2-D padding mask of the announced forward's sliding layers (None: no padding). Decided on the
        host, reading nothing from the device: a batch that may hold padding always gets the mask."""
        return self.current.long() if self.maybe_padded else None

    def positions(self, next_position: torch.Tensor) -> torch.Tensor:
        """Logical positions of the stored slots, ``[batch, stored]`` (-1: padding).

        ``next_position`` ``[batch]`` counts each row's real tokens seen, so the newest real slot
        of a row sits at ``next_position - 1`` and every real slot before it one position lower.
        """
        valid = self.stored
        after = valid.long().flip(1).cumsum(1).flip(1)  # real slots at or after each slot
        positions = next_position.to(valid.device).unsqueeze(1) - after
        return positions.masked_fill(~valid, -1)
