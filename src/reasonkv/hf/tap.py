"""The attention tap: a listener sees each attention call's post-RoPE queries and keys, while the
model's own kernel (SDPA, FlashAttention, eager) still does the attention.

Post-RoPE queries exist only inside the attention kernel call, so the tap wraps the kernel the model
runs in transformers' attention registry, through its public ``AttentionInterface.register``. The
wrapper calls a listener only for attention modules claimed by an :class:`AttentionTap`; every other
module (another model, or this one once released) goes straight to the original kernel, so tapping
one model never changes another's results. The wrapper is installed when the first tap on a kernel
name opens and the original is registered back when the last one closes (or is garbage-collected):
a model's ``attn_implementation`` is never changed, and nothing stays wrapped afterwards.

A compiled decode step cannot call a Python listener (and ``torch.compile`` cannot trace the claims on
every torch release), so it reports differently: it passes its query buffers to the forward as the keyword
argument ``STEP_QUERIES`` (``{layer index: [batch, heads, 1, head_dim]}``), which transformers hands down to
the attention kernel, and the wrapper copies each layer's query into its buffer. :func:`kernel_tap` holds
the wrapper registered for one compiled run; the wrapper is one object per original kernel, so the graphs
traced in one run (which check the registered kernel's identity) are still valid in the next.

``"eager"`` has no registry entry of its own (models fall back to their module's
``eager_attention_forward``): tapping it registers a plain dispatcher to that function, which is what
stays registered after the last tap closes; it computes exactly what the fallback computes.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from reasonkv.hf.model import attention_implementation, attention_modules

__all__ = ["STEP_QUERIES", "AttentionTap", "KernelReader", "Listener", "Reader", "check_untapped", "kernel_tap"]

# listener(layer, query [B, Hq, q, D], key [B, Hkv, S, D], attention_mask, kernel keyword arguments)
Listener = Callable[[int, torch.Tensor, torch.Tensor, Any, dict], None]

# reader(layer, query, key, value) -> None (read everything) or (key, value, additive mask) to attend to instead
Reader = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, ...] | None"]

_CLAIM = "_reasonkv_tap"  # attribute set on claimed attention modules (this package's own attribute)
_READER = "_reasonkv_reader"  # attribute set on attention modules whose K/V reads a selection chooses
_lock = threading.Lock()
_installed: dict[str, list] = {}  # kernel name -> [original, wrapper, open taps]
_wrappers: dict[Callable, Callable] = {}  # original kernel -> its wrapper (one, so graph guards stay valid)
STEP_QUERIES = "reasonkv_step_queries"  # a compiled step's keyword argument: {layer: query buffer}


class _Claim:
    """A claimed module's layer index and its listener, held weakly: a bound method as its owner (weakly)
    and its function, a plain function as a weak reference to itself. (Not ``weakref.WeakMethod``, and no
    bound method rebuilt from the function: neither traces on every torch release.)"""

    __slots__ = ("function", "layer", "owner")

    def __init__(self, layer: int, listener: Listener):
        self.layer = layer
        bound = hasattr(listener, "__self__")
        self.owner = weakref.ref(listener.__self__ if bound else listener)
        self.function = listener.__func__ if bound else None

    def notify(self, query, key, attention_mask, kwargs) -> None:
        owner = self.owner()
        if owner is None:
            return
        if self.function is None:
            owner(self.layer, query, key, attention_mask, kwargs)
        else:
            self.function(owner, self.layer, query, key, attention_mask, kwargs)


def _module_eager(module, *args, **kwargs):
    """The eager kernel of ``module``'s own modeling file, what transformers runs for ``"eager"``."""
    eager = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to run")
    return eager(module, *args, **kwargs)


def _wrapped(kernel):
    wrapper = _wrappers.get(kernel)
    if wrapper is not None:
        return wrapper

    def tapped_attention(module, query, key, value, attention_mask, *args, **kwargs):
        queries = kwargs.pop(STEP_QUERIES, None)
        if queries is not None:  # a compiled step: its buffers, no listener
            queries[module.layer_idx].copy_(query)
        else:
            claim = getattr(module, _CLAIM, None)
            if claim is not None:
                claim.notify(query, key, attention_mask, kwargs)
            readers = getattr(module, _READER, None)
            if readers:  # one per selecting cache open on this module: the one whose forward this is answers
                for reader in list(readers.values()):
                    chosen = reader(query, key, value)
                    if chosen is not None:
                        key, value, attention_mask = chosen
                        break
        return kernel(module, query, key, value, attention_mask, *args, **kwargs)

    tapped_attention.__wrapped__ = kernel
    _wrappers[kernel] = tapped_attention
    return tapped_attention


def _acquire(name: str) -> None:
    with _lock:
        entry = _installed.get(name)
        if entry is not None:
            entry[2] += 1
            return
        if name in ALL_ATTENTION_FUNCTIONS:
            original = ALL_ATTENTION_FUNCTIONS[name]
        elif name == "eager":
            original = _module_eager
        else:
            raise ValueError(f"attention implementation {name!r} is not registered in transformers")
        wrapper = _wrapped(original)
        AttentionInterface.register(name, wrapper)
        _installed[name] = [original, wrapper, 1]


def _release(name: str) -> None:
    with _lock:
        entry = _installed.get(name)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] > 0:
            return
        del _installed[name]
        original, wrapper, _ = entry
        # Someone registered their own kernel over ours meanwhile: theirs stays.
        if name in ALL_ATTENTION_FUNCTIONS and ALL_ATTENTION_FUNCTIONS[name] is wrapper:
            AttentionInterface.register(name, original)


@contextmanager
def kernel_tap(name: str) -> Iterator[None]:
    """The wrapper registered for kernel ``name`` inside the block (for a compiled run's ``STEP_QUERIES``),
    the original kernel back after it unless a tap is still open."""
    _acquire(name)
    try:
        yield
    finally:
        _release(name)


def check_untapped(model: torch.nn.Module) -> None:
    """Raise RuntimeError unless ``model`` runs its attention kernel untouched: the kernel registered for its
    attention implementation is not reasonkv's wrapper and none of its attention modules is claimed (what a
    plain transformers measurement needs)."""
    name = attention_implementation(model)
    registered = ALL_ATTENTION_FUNCTIONS.get(name)
    if name in _installed or any(registered is wrapper for wrapper in _wrappers.values()):
        raise RuntimeError(f"the {name!r} attention kernel is still wrapped by reasonkv's tap")
    claimed = [
        i for i, module in enumerate(attention_modules(model)) if hasattr(module, _CLAIM) or hasattr(module, _READER)
    ]
    if claimed:
        raise RuntimeError(f"attention modules of layers {claimed} are still claimed by reasonkv's tap")


class AttentionTap:
    """Route the attention calls of ``model`` to ``listener`` until :meth:`close`.

    The listener receives the layer index, the query and key tensors exactly as the kernel gets
    them (post-RoPE; keys include the cached ones), the attention mask and the kernel's keyword
    arguments (``scaling``, ``softcap``, ``s_aux``, ...). It is held weakly.
    """

    def __init__(self, model: torch.nn.Module, listener: Listener):
        self.name = attention_implementation(model)
        self.modules = attention_modules(model)
        if all(m is None for m in self.modules):
            raise ValueError(f"{type(model).__name__} has no attention module to tap")
        self._claims = [None if m is None else _Claim(i, listener) for i, m in enumerate(self.modules)]
        _acquire(self.name)
        self._finalizer = weakref.finalize(self, _release, self.name)
        self.claim()

    def claim(self) -> None:
        """(Re)claim the model's attention modules, e.g. after another tap on the same model claimed them.

        A tap claims every module of its model at once, so the first module tells whether they are still
        this tap's: then nothing is written (the common case, once per forward)."""
        first = next(i for i, module in enumerate(self.modules) if module is not None)
        if getattr(self.modules[first], _CLAIM, None) is self._claims[first]:
            return
        for module, claim in zip(self.modules, self._claims, strict=True):
            if module is not None:
                setattr(module, _CLAIM, claim)

    def close(self) -> None:
        """Stop listening; unregister the wrapper if this was the last open tap on the kernel."""
        if not self._finalizer.alive:
            return
        for module, claim in zip(self.modules, self._claims, strict=True):
            if module is not None and getattr(module, _CLAIM, None) is claim:
                delattr(module, _CLAIM)
        self._finalizer()

    def __enter__(self) -> AttentionTap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KernelReader:
    """Let ``reader`` choose what the attention of ``model``'s full-attention layers reads, until :meth:`close`.

    For every attention call of a module in ``layers``, ``reader(layer, query, key, value)`` (post-RoPE query,
    the cache's whole K/V) returns None (the kernel reads everything) or ``(key, value, mask)``: the K/V the
    kernel attends to instead and the additive mask over them (``[batch, heads, q, n]``). The model's own
    kernel still computes the attention. Held weakly, like a tap's listener. A compiled step does not call it.
    """

    def __init__(self, model: torch.nn.Module, reader: Reader, layers: Iterator[int] | None = None):
        self.name = attention_implementation(model)
        if self.name not in ("sdpa", "eager"):
            raise ValueError(
                f"a selection policy reads chosen blocks through the sdpa or eager attention kernel; this model "
                f"runs {self.name!r}: load it with attn_implementation='sdpa'"
            )
        modules = attention_modules(model)
        wanted = set(range(len(modules)) if layers is None else layers)
        self.modules = {i: m for i, m in enumerate(modules) if m is not None and i in wanted}
        owner = weakref.ref(reader.__self__) if hasattr(reader, "__self__") else None
        function = reader.__func__ if owner is not None else reader
        _acquire(self.name)
        self._finalizer = weakref.finalize(self, _release, self.name)
        for layer, module in self.modules.items():
            if not hasattr(module, _READER):
                setattr(module, _READER, {})
            getattr(module, _READER)[id(self)] = _bound_reader(owner, function, layer)

    def close(self) -> None:
        if not self._finalizer.alive:
            return
        for module in self.modules.values():
            readers = getattr(module, _READER, {})
            readers.pop(id(self), None)
            if not readers and hasattr(module, _READER):
                delattr(module, _READER)
        self._finalizer()


def _bound_reader(owner, function, layer: int):
    def read(query, key, value):
        if owner is None:
            return function(layer, query, key, value)
        target = owner()
        return None if target is None else function(target, layer, query, key, value)

    return read
