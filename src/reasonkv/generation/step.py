"""The decode step and the one loop that runs it.

A step maps a batch's next input ids and padding mask to the newest logits ``[batch, vocab]`` (the cache
evicts after it). :func:`open_step` builds it eager (:class:`EagerStep`), compiled
(:class:`~reasonkv.generation.compiled.CompiledDecode`) or static (:class:`~reasonkv.generation.compiled.StaticStep`,
plain transformers compiled, the reference); everything that decodes runs it through :func:`decode`. Each has
``prefill`` (always eager), ``warmup_seconds`` (tracing time, reported apart), ``describe()`` (what ran; None
for eager) and ``close()`` (removes what it installed on the model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reasonkv.generation.compiled import CompiledDecode, StaticStep
from reasonkv.hf import Forward

__all__ = ["CompiledDecode", "EagerStep", "StaticStep", "decode", "open_step"]


class EagerStep:
    """The model's eager forward over ``cache``: the newest logits of any number of tokens a row
    (``every_position``: the logits of every token fed, ``[batch, tokens, vocab]``, as a teacher-forced replay
    reads them; :meth:`prefill` still returns the newest)."""

    compiled = False
    warmup_seconds = 0.0

    def __init__(self, model, cache, *, every_position: bool = False):
        self.model, self.cache, self.every_position = model, cache, every_position
        self.device = next(model.parameters()).device
        self._forward = Forward(model)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.every_position:
            return self._forward(input_ids, self.cache, attention_mask=attention_mask).logits
        return self.prefill(input_ids, attention_mask)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._forward.newest_logits(input_ids, self.cache, attention_mask)

    def describe(self) -> dict | None:
        return None

    def close(self) -> None:
        pass


def open_step(model, cache, compile: str | None = None):
    """The decode step over reasonkv's ``cache``: eager (``compile=None``), or compiled with that
    ``torch.compile`` backend (:class:`~reasonkv.generation.compiled.CompiledDecode`, eager where the cache has
    no fixed-shape layout, saying why)."""
    if compile is None:
        return EagerStep(model, cache)
    return CompiledDecode(model, cache, backend=compile)


def decode(step, logits: torch.Tensor, next_input: Callable, after_step: Callable | None = None) -> torch.Tensor:
    """The decode loop: ``next_input(index, logits)`` turns the newest logits into step ``index``'s
    ``(input_ids, attention_mask)``, or None to stop; ``step`` runs it; ``after_step(index + 1)`` follows every
    step (the prefill was step 0). Returns the last logits."""
    index = 0
    while (inputs := next_input(index, logits)) is not None:
        logits = step(*inputs)
        index += 1
        if after_step is not None:
            after_step(index)
    return logits
