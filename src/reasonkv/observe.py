"""Signal recording: only what the active policy declares it needs.

- residual-stream hidden states of named decoder layers (forward hooks on the decoder layers);
- the most recent ``w`` post-RoPE query vectors of every layer (kept in :class:`~reasonkv.recorded.Recorded`);
- the attention of each forward's newest query (or the column sums over a forward's queries),
  recomputed from the query and the cached keys (:mod:`reasonkv.attention`), with the kernel's
  soft-cap and learned sinks when the model has them.

Queries and attention are recorded for the evicting (full-attention) layers only: on a hybrid
model the sliding-window and linear layers are not evicted, so nothing reads their attention.

Queries come from the attention tap (:class:`reasonkv.hf.AttentionTap`), which shows them on their
way into the model's own kernel: SDPA / FlashAttention still do the attention.
"""

from __future__ import annotations

import weakref

import torch

from reasonkv import attention
from reasonkv.contract import Needs, Step
from reasonkv.hf import AttentionTap, decoder_layers
from reasonkv.recorded import Recorded
from reasonkv.timing import Stopwatch

__all__ = ["Observer"]


def _hidden_hook(ref: weakref.ReferenceType, index: int):
    def record(module, args, output):
        observer = ref()
        if observer is not None:
            observer.record_hidden(index, output)

    return record


class Observer:
    """Records the signals of ``needs`` for one model and one cache while ``active``."""

    def __init__(self, model: torch.nn.Module, cache, needs: Needs, stopwatch: Stopwatch | None = None):
        self.cache, self.needs = cache, needs
        self.stopwatch = stopwatch or Stopwatch()
        self.active = False
        self.recorded = Recorded(needs.query_window)
        self.handles = []  # hook handles held by the model; the hooks hold this observer weakly
        self._step: Step | None = None
        self.attention_layers = frozenset(cache.full_layers)  # only the evicting layers' attention counts
        layers = decoder_layers(model)
        for index in needs.hidden_layers:
            if not 0 <= index < len(layers):
                raise ValueError(f"hidden layer {index} out of range: the model has {len(layers)} layers")
            self.handles.append(layers[index].register_forward_hook(_hidden_hook(weakref.ref(self), index)))
        self.tap = AttentionTap(model, self.on_attention) if needs.taps_attention else None

    def record_hidden(self, index: int, output) -> None:
        if self.active:
            self._step.hidden[index] = output[0] if isinstance(output, tuple) else output

    def begin(self, input_valid: torch.Tensor, input_positions: torch.Tensor) -> None:
        if self.tap is not None:  # another cache on the same model may have claimed the modules since
            self.tap.claim()
        positions = input_positions.masked_fill(~input_valid, -1)
        self._step = Step(input_valid=input_valid, input_positions=positions)
        self.active = True

    def end(self) -> Step:
        self.active = False
        step, self._step = self._step, None
        return step

    def reset(self) -> None:
        self.recorded.reset()

    def detach(self) -> None:
        self.active = False
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.tap is not None:
            self.tap.close()

    # ---------------------------------------------------------------- attention tap
    def on_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, mask, kwargs: dict) -> None:
        if not self.active or layer not in self.attention_layers:
            return
        with self.stopwatch("record"):
            self._record_attention(layer, query, key, kwargs)

    def _record_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
        step, needs = self._step, self.needs
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux", kwargs.get("sinks"))
        self.recorded.scalings[layer] = scaling
        if softcap is not None:
            self.recorded.softcaps[layer] = softcap
        if sinks is not None:
            self.recorded.sinks[layer] = sinks.detach()
        if needs.query_window:
            self.recorded.push_queries(layer, query, step.input_positions, step.input_valid)
        if not (needs.attention_last or needs.attention_sum):
            return
        key_valid = self.cache.valid  # includes this forward's tokens
        step.slot_positions[layer] = self.cache.positions(layer)
        if needs.attention_last:
            step.attention_last[layer] = attention.newest_row(query[:, :, -1:], key, key_valid, scaling, softcap, sinks)
        if needs.attention_sum:
            step.attention_sum[layer] = (
                step.attention_last[layer]
                if query.shape[2] == 1 and needs.attention_last
                else attention.column_sums(
                    query, key, key_valid, step.input_valid, scaling, softcap=softcap, sinks=sinks
                )
            )
