"""The attention tap: a listener sees each attention call's post-RoPE queries and keys, while the
model's own kernel (SDPA, FlashAttention, eager) still does the attention.

Post-RoPE queries exist only inside the attention kernel call, so the tap wraps the kernel the model
runs in transformers' attention registry, through its public ``AttentionInterface.register``. The
wrapper calls a listener only for attention modules claimed by an :class:`AttentionTap`; every other
module (another model, or this one once released) goes straight to the original kernel, so tapping
one model never changes another's results. The wrapper is installed when the first tap on a kernel
name opens and the original is registered back when the last one closes (or is garbage-collected):
a model's ``attn_implementation`` is never changed, and nothing stays wrapped afterwards.

``"eager"`` has no registry entry of its own (models fall back to their module's
``eager_attention_forward``): tapping it registers a plain dispatcher to that function, which is what
stays registered after the last tap closes; it computes exactly what the fallback computes.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from reasonkv.hf.model import attention_implementation, attention_modules

__all__ = ["AttentionTap", "Listener"]

# listener(layer, query [B, Hq, q, D], key [B, Hkv, S, D], attention_mask, kernel keyword arguments)
Listener = Callable[[int, torch.Tensor, torch.Tensor, Any, dict], None]

_CLAIM = "_reasonkv_tap"  # attribute set on claimed attention modules (this package's own attribute)
_lock = threading.Lock()
_installed: dict[str, list] = {}  # kernel name -> [original, wrapper, open taps]


class _Claim:
    """A claimed module's layer index and its listener, held weakly: a bound method as its owner (weakly)
    and its function, a plain function as a weak reference to itself. (Not ``weakref.WeakMethod``, which
    ``torch.compile`` cannot trace: a compiled decode step runs through this wrapper.)"""

    __slots__ = ("function", "layer", "owner")

    def __init__(self, layer: int, listener: Listener):
        self.layer = layer
        bound = hasattr(listener, "__self__")
        self.owner = weakref.ref(listener.__self__ if bound else listener)
        self.function = listener.__func__ if bound else None

    def listener(self) -> Listener | None:
        owner = self.owner()
        if owner is None or self.function is None:
            return owner
        return self.function.__get__(owner)


def _module_eager(module, *args, **kwargs):
    """The eager kernel of ``module``'s own modeling file, what transformers runs for ``"eager"``."""
    eager = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to run")
    return eager(module, *args, **kwargs)


def _wrapped(kernel):
    def tapped_attention(module, query, key, value, attention_mask, *args, **kwargs):
        claim = getattr(module, _CLAIM, None)
        if claim is not None:
            listener = claim.listener()
            if listener is not None:
                listener(claim.layer, query, key, attention_mask, kwargs)
        return kernel(module, query, key, value, attention_mask, *args, **kwargs)

    tapped_attention.__wrapped__ = kernel
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
