"""A model's per-step signals written into fixed buffers, for compiled decode steps.

A compiled step runs no Python of its own, so the hooks an eager forward reports through (the
evictor's observer appends to logs, a new set for each run) cannot run inside it. A
:class:`StepCapture` is what runs there instead: one per model, made once and kept for the model's
life, whose hooks copy the newest token's output of every decoder layer and post-RoPE query of every
attention layer into buffers allocated for the batch, while :attr:`StepCapture.active`. The hooks and
the buffers' places stay the same from one run to the next, so a compiled graph traced in one run is
still right in the next (``torch.compile`` checks how many hooks a module has, not which ones).
"""

from __future__ import annotations

import weakref

import torch

from reasonkv.hf.model import attention_modules, decoder_layers, text_config
from reasonkv.hf.tap import AttentionTap

__all__ = ["StepCapture"]

_captures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its StepCapture


def _hidden_hook(ref: weakref.ReferenceType, index: int):
    def copy_newest(module, args, output):
        capture = ref()
        if capture is not None and capture.active:
            hidden = output[0] if isinstance(output, tuple) else output
            capture.hidden[index].copy_(hidden[:, -1:])

    return copy_newest


class StepCapture:
    """The newest token's hidden state of every decoder layer (``hidden[i]``, ``[batch, 1, hidden_size]``)
    and post-RoPE query of every attention layer (``queries[i]``, ``[batch, heads, 1, head_dim]``), written
    by each forward while :attr:`active`. Get a model's with :meth:`of`."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> StepCapture:
        capture = _captures.get(model)
        if capture is None:
            capture = _captures[model] = cls(model)
        return capture

    def __init__(self, model: torch.nn.Module):
        self.active = False
        self.hidden: dict[int, torch.Tensor] = {}
        self.queries: dict[int, torch.Tensor] = {}
        config = text_config(model)
        self._hidden_size = config.hidden_size
        self._layers = [i for i, module in enumerate(attention_modules(model)) if module is not None]
        me = weakref.ref(self)
        self._handles = [
            layer.register_forward_hook(_hidden_hook(me, i)) for i, layer in enumerate(decoder_layers(model))
        ]
        self.tap = AttentionTap(model, self._on_attention)

    def allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Buffers for a batch of ``batch`` rows (kept when they already have that shape)."""
        hidden_shape, query_shape = (batch, 1, self._hidden_size), (batch, heads, 1, head_dim)
        first = self.hidden.get(0)
        if first is not None and first.shape == hidden_shape and first.dtype == dtype and first.device == device:
            return
        self.hidden = {i: torch.zeros(hidden_shape, dtype=dtype, device=device) for i in range(len(self._handles))}
        self.queries = {i: torch.zeros(query_shape, dtype=dtype, device=device) for i in self._layers}
        if device.type == "cuda":  # CUDA graphs write these in place at every replay
            for buffer in (*self.hidden.values(), *self.queries.values()):
                torch._dynamo.mark_static_address(buffer)

    def _on_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, mask, kwargs: dict) -> None:
        if self.active:
            self.queries[layer].copy_(query)
