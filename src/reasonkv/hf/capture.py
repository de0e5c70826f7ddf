"""A model's per-step signals written into fixed buffers, for compiled decode steps, which run no Python hook.

A :class:`StepCapture` (one per model, kept for its life) holds buffers for the newest token's output of
every decoder layer and post-RoPE query of every attention layer. They travel into the forward as keyword
arguments, which transformers hands down to each decoder layer and attention kernel, where forward hooks
and the tap's kernel wrapper (:func:`reasonkv.hf.tap.kernel_tap`) copy into them. Hooks and wrapper are
installed for one compiled run (:meth:`StepCapture.open`) and removed after it; they and the buffers are
the same objects from run to run, so a graph traced in one run stays right in the next."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from reasonkv.hf.model import attention_implementation, attention_modules, decoder_layers, text_config
from reasonkv.hf.tap import STEP_QUERIES, kernel_tap

__all__ = ["STEP_HIDDEN", "StepCapture"]

STEP_HIDDEN = "reasonkv_step_hidden"  # a compiled step's keyword argument: one buffer per decoder layer

_captures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its StepCapture


def _copy_newest(module, args, kwargs, output, index: int):
    buffers = kwargs.get(STEP_HIDDEN)
    if buffers is not None:
        hidden = output[0] if isinstance(output, tuple) else output
        buffers[index].copy_(hidden[:, -1:])


class StepCapture:
    """The newest token's hidden state of every decoder layer (``hidden[i]``, ``[batch, 1, hidden_size]``)
    and post-RoPE query of every attention layer (``queries[i]``, ``[batch, heads, 1, head_dim]``), written
    by each forward given :meth:`step_inputs` inside :meth:`open`. Get a model's with :meth:`of`.

    :attr:`blocker` says why a model cannot report this way (None: it can)."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> StepCapture:
        capture = _captures.get(model)
        if capture is None:
            capture = _captures[model] = cls(model)
        return capture

    def __init__(self, model: torch.nn.Module):
        self.hidden: list[torch.Tensor] = []
        self.queries: dict[int, torch.Tensor] = {}
        self._hidden_size = text_config(model).hidden_size
        self._model = weakref.ref(model)  # the model owns its capture (weakly keyed), not the reverse
        self._kernel = attention_implementation(model)
        modules = attention_modules(model)
        self._layers = [i for i, module in enumerate(modules) if module is not None]
        self._hooks = [functools.partial(_copy_newest, index=i) for i in range(len(decoder_layers(model)))]
        misnumbered = [i for i in self._layers if getattr(modules[i], "layer_idx", None) != i]
        self.blocker = None
        if misnumbered:
            self.blocker = f"the attention modules of layers {misnumbered} do not carry their layer index (layer_idx)"

    def allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Buffers for a batch of ``batch`` rows (kept when they already have that shape)."""
        hidden_shape, query_shape = (batch, 1, self._hidden_size), (batch, heads, 1, head_dim)
        first = self.hidden[0] if self.hidden else None
        if first is not None and first.shape == hidden_shape and first.dtype == dtype and first.device == device:
            return
        self.hidden = [torch.zeros(hidden_shape, dtype=dtype, device=device) for _ in self._hooks]
        self.queries = {i: torch.zeros(query_shape, dtype=dtype, device=device) for i in self._layers}
        if device.type == "cuda":  # CUDA graphs write these in place at every replay
            for buffer in (*self.hidden, *self.queries.values()):
                torch._dynamo.mark_static_address(buffer)

    def step_inputs(self) -> dict:
        """The keyword arguments a step's forward takes to write into the buffers."""
        return {STEP_HIDDEN: self.hidden, STEP_QUERIES: self.queries}

    @contextmanager
    def open(self) -> Iterator[StepCapture]:
        """The hooks and the kernel wrapper installed for the block (one compiled run), removed after it."""
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this StepCapture is gone")
        handles = [
            layer.register_forward_hook(hook, with_kwargs=True)
            for layer, hook in zip(decoder_layers(model), self._hooks, strict=True)
        ]
        try:
            with kernel_tap(self._kernel):
                yield self
        finally:
            for handle in handles:
                handle.remove()
