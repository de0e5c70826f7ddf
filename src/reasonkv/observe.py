"""Signal recording: only what the active policy declares it needs.

- residual-stream hidden states of named decoder layers (forward hooks on the decoder layers);
- the most recent ``w`` post-RoPE query vectors of every layer;
- the attention of the newest query (or the column sums over a forward's queries), recomputed
  from the recorded query and the cached keys.

Queries are read by wrapping the model's configured attention kernel in transformers' attention
registry: the wrapper records, then calls the original kernel, so SDPA / FlashAttention still do
the attention itself. The wrapper is transparent (a single attribute lookup) for every module that
has no observer attached, so installing it never changes another model's behaviour.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
from transformers.modeling_utils import AttentionInterface

from reasonkv.timing import Stopwatch

__all__ = ["Needs", "Step", "Observer", "decoder_layers", "recent_window_attention"]

_TAP_ATTR = "_reasonkv_observer"
_TAPPED_FLAG = "_reasonkv_tapped"


@dataclass(frozen=True)
class Needs:
    """What a policy reads. The observer records nothing else."""

    hidden_layers: tuple[int, ...] = ()  # residual-stream outputs of these decoder layers
    query_window: int = 0  # keep the most recent `query_window` queries of every layer
    attention_last: bool = False  # attention row of each forward's newest query, every layer
    attention_sum: bool = False  # attention column sums over all queries of each forward, every layer

    def union(self, other: Needs) -> Needs:
        return Needs(
            hidden_layers=tuple(sorted(set(self.hidden_layers) | set(other.hidden_layers))),
            query_window=max(self.query_window, other.query_window),
            attention_last=self.attention_last or other.attention_last,
            attention_sum=self.attention_sum or other.attention_sum,
        )

    @property
    def taps_attention(self) -> bool:
        return self.query_window > 0 or self.attention_last or self.attention_sum


@dataclass
class Step:
    """What one forward pass (a prefill or a decode step) produced, handed to ``Policy.observe``.

    Attention tensors are ``[batch, query_heads, slots]`` over the slots stored during that
    forward (the cache layout before any eviction that follows it); padding slots get 0.
    """

    input_valid: torch.Tensor  # [batch, q] real (True) vs padding tokens of this forward
    input_positions: torch.Tensor  # [batch, q] their logical positions (-1 for padding)
    slot_positions: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [batch, kv_heads, slots]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [batch, q, hidden]
    attention_last: dict[int, torch.Tensor] = field(default_factory=dict)
    attention_sum: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def is_prefill(self) -> bool:
        return self.input_valid.shape[1] > 1


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM."""
    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
        language_model = getattr(owner, "language_model", None)
        if language_model is not None and isinstance(getattr(language_model, "layers", None), torch.nn.ModuleList):
            return language_model.layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def _attention_module(layer: torch.nn.Module) -> torch.nn.Module:
    for name in ("self_attn", "attention", "attn"):
        module = getattr(layer, name, None)
        if module is not None:
            return module
    raise ValueError(f"cannot find the attention module of {type(layer).__name__}")


def _model_eager(module, *args, **kwargs):
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to wrap")
    return eager(module, *args, **kwargs)


def _tapped(kernel):
    def attention_with_tap(module, query, key, value, attention_mask, *args, **kwargs):
        ref = getattr(module, _TAP_ATTR, None)
        observer = ref() if ref is not None else None
        if observer is not None and observer.active:
            observer.on_attention(module, query, key, kwargs.get("scaling"))
        return kernel(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(attention_with_tap, _TAPPED_FLAG, True)
    attention_with_tap.__wrapped__ = kernel
    return attention_with_tap


def install_tap(kernel_name: str) -> None:
    """Wrap the registered attention kernel ``kernel_name`` once (idempotent, transparent)."""
    current = AttentionInterface._global_mapping.get(kernel_name)
    if current is None:
        if kernel_name != "eager":
            raise ValueError(f"attention implementation {kernel_name!r} is not registered in transformers")
        current = _model_eager
    if not getattr(current, _TAPPED_FLAG, False):
        AttentionInterface.register(kernel_name, _tapped(current))


def _grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, q, D] -> [B, Hkv, g*q, D]`` matching transformers' ``repeat_kv`` head order."""
    b, hq, q, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * q, d)


def recent_window_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Softmax attention of a few recorded queries over the stored keys, ``O(w * slots)`` memory.

    Parameters: ``queries [B, Hq, w, D]`` with ``query_positions``/``query_valid`` ``[B, w]``;
    ``keys [B, Hkv, S, D]`` with ``key_positions [B, Hkv, S]`` and ``key_valid [B, S]``.
    A query sees the keys at or before its own logical position (causal). Returns
    ``[B, Hq, w, S]`` probabilities (rows of padding queries are 0).
    """
    b, hq, w, _ = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    logits = torch.matmul(_grouped(queries, hkv).float(), keys.float().transpose(2, 3)) * scaling
    logits = logits.view(b, hkv, g, w, s)
    visible = key_positions.view(b, hkv, 1, 1, s) <= query_positions.view(b, 1, 1, w, 1)
    visible &= key_valid.view(b, 1, 1, 1, s) & query_valid.view(b, 1, 1, w, 1)
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return probs.view(b, hq, w, s)


def _hidden_hook(ref: weakref.ReferenceType, index: int):
    def record(module, args, output):
        observer = ref()
        if observer is not None:
            observer.record_hidden(index, output)

    return record


class _QueryWindow:
    """Ring buffer of the last ``w`` queries of one layer, with their positions and validity."""

    def __init__(self, w: int):
        self.w = w
        self.queries: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self._next = 0

    def push(self, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        b, h, q, d = queries.shape
        if self.queries is None:
            self.queries = queries.new_zeros((b, h, self.w, d))
            self.positions = positions.new_full((b, self.w), -1)
            self.valid = valid.new_zeros((b, self.w))
        if q >= self.w:
            self.queries.copy_(queries[:, :, -self.w :])
            self.positions.copy_(positions[:, -self.w :])
            self.valid.copy_(valid[:, -self.w :])
            self._next = 0
            return
        slots = (torch.arange(q, device=queries.device) + self._next) % self.w
        self.queries[:, :, slots] = queries
        self.positions[:, slots] = positions
        self.valid[:, slots] = valid
        self._next = (self._next + q) % self.w


class Observer:
    """Records the signals of ``needs`` for one model and one cache while ``active``."""

    def __init__(self, model: torch.nn.Module, cache, needs: Needs, stopwatch: Stopwatch | None = None):
        self.model, self.cache, self.needs = model, cache, needs
        self.stopwatch = stopwatch or Stopwatch()
        self.active = False
        self.layers = decoder_layers(model)
        self.attention_modules = [_attention_module(layer) for layer in self.layers]
        self.handles = []  # hook handles held by the model; the hooks hold this observer weakly
        self._step: Step | None = None
        self.windows: dict[int, _QueryWindow] = {}
        self.scalings: dict[int, float] = {}
        for index in needs.hidden_layers:
            if not 0 <= index < len(self.layers):
                raise ValueError(f"hidden layer {index} out of range: the model has {len(self.layers)} layers")
            self.handles.append(self.layers[index].register_forward_hook(_hidden_hook(weakref.ref(self), index)))
        if needs.taps_attention:
            install_tap(model.config._attn_implementation or "eager")
            self._claim_modules()

    def _claim_modules(self) -> None:
        ref = weakref.ref(self)
        for module in self.attention_modules:
            setattr(module, _TAP_ATTR, ref)

    def record_hidden(self, index: int, output) -> None:
        if self.active:
            self._step.hidden[index] = output[0] if isinstance(output, tuple) else output

    def begin(self, input_valid: torch.Tensor, input_positions: torch.Tensor) -> None:
        if self.needs.taps_attention:  # another observer may have claimed the modules since
            self._claim_modules()
        positions = input_positions.masked_fill(~input_valid, -1)
        self._step = Step(input_valid=input_valid, input_positions=positions)
        self.active = True

    def end(self) -> Step:
        self.active = False
        step, self._step = self._step, None
        return step

    def reset(self) -> None:
        self.windows = {}

    def detach(self) -> None:
        self.active = False
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for module in self.attention_modules:
            ref = getattr(module, _TAP_ATTR, None)
            if ref is not None and ref() in (self, None):
                delattr(module, _TAP_ATTR)

    # ---------------------------------------------------------------- attention tap
    def on_attention(self, module, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        with self.stopwatch("record"):
            self._record_attention(module.layer_idx, query, key, scaling)

    def _record_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        step, needs = self._step, self.needs
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        self.scalings[layer] = scaling
        q = query.shape[2]
        if needs.query_window:
            window = self.windows.setdefault(layer, _QueryWindow(needs.query_window))
            window.push(query, step.input_positions, step.input_valid)
        if not (needs.attention_last or needs.attention_sum):
            return
        key_valid = self.cache.valid  # includes this forward's tokens
        step.slot_positions[layer] = self.cache.positions(layer)
        if needs.attention_last:
            step.attention_last[layer] = self._last_row(query[:, :, -1:], key, key_valid, scaling)
        if needs.attention_sum:
            step.attention_sum[layer] = (
                step.attention_last[layer]
                if q == 1 and needs.attention_last
                else self._column_sums(query, key, key_valid, step.input_valid, scaling)
            )

    @staticmethod
    def _last_row(query, key, key_valid, scaling) -> torch.Tensor:
        b, hq = query.shape[:2]
        hkv, s = key.shape[1], key.shape[2]
        logits = torch.matmul(_grouped(query, hkv).float(), key.float().transpose(2, 3)) * scaling
        logits = logits.view(b, hq, s).masked_fill(~key_valid.view(b, 1, s), float("-inf"))
        return logits.softmax(-1)

    @staticmethod
    def _column_sums(query, key, key_valid, query_valid, scaling, chunk_elements: int = 1 << 24):
        b, hq, q, d = query.shape
        hkv, s = key.shape[1], key.shape[2]
        g = hq // hkv
        keys_t = key.float().transpose(2, 3)
        total = query.new_zeros((b, hq, s), dtype=torch.float32)
        chunk = max(1, chunk_elements // max(1, b * hq * s))
        slot = torch.arange(s, device=query.device)
        for start in range(0, q, chunk):
            part = query[:, :, start : start + chunk].float()
            c = part.shape[2]
            logits = torch.matmul(part.reshape(b, hkv, g * c, d), keys_t).view(b, hq, c, s) * scaling
            query_slot = s - q + start + torch.arange(c, device=query.device)
            visible = (slot.view(1, 1, 1, s) <= query_slot.view(1, 1, c, 1)) & key_valid.view(b, 1, 1, s)
            probs = logits.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
            probs = probs * query_valid[:, start : start + c].view(b, 1, c, 1)
            total += probs.sum(2)
        return total
