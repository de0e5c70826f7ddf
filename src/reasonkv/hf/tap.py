"""The attention tap: hooks see each attention call's post-RoPE queries, keys, values and mask, and may hand
the kernel other K/V to read, while the model's own kernel (SDPA, FlashAttention, eager) still attends.

Post-RoPE queries exist only inside the kernel call, so the tap wraps the kernel in transformers' attention
registry (``AttentionInterface.register``). The wrapper calls hooks only for attention modules that hold
some (one kind: an :class:`AttentionTap`'s listens, a :class:`KernelReader`'s may replace what is read);
every other module goes straight to the original kernel, so tapping one model never changes another's
results. The wrapper is registered while a hook on its kernel name is open, the original back after the
last closes (or is collected): a model's ``attn_implementation`` never changes and nothing stays wrapped.

A compiled decode step cannot call Python hooks (nor can ``torch.compile`` trace them on every release):
it passes query buffers as the keyword argument ``STEP_QUERIES`` (``{layer: [batch, heads, 1, head_dim]}``),
which the wrapper fills. :func:`kernel_tap` holds the wrapper for one compiled run; it is one object per
original kernel, so graphs traced in one run (guarded on its identity) stay valid in the next.

``"eager"`` has no registry entry of its own (models fall back to their module's ``eager_attention_forward``):
tapping it registers a plain dispatcher to that function, which stays registered and computes the same.
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

# reader(layer, query, key, value, attention_mask, kernel keyword arguments) -> None (read everything) or
# (key, value, additive mask) to attend to instead
Reader = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, Any, dict], "tuple[torch.Tensor, ...] | None"]

_HOOKS = "_reasonkv_hooks"  # attribute set on hooked attention modules (this package's own): {key: _Hook}
_LISTENER = "listener"  # the hook key of a tap: one listener per module, the latest claim's
_lock = threading.Lock()
_installed: dict[str, list] = {}  # kernel name -> [original, wrapper, open taps]
_wrappers: dict[Callable, Callable] = {}  # original kernel -> its wrapper (one, so graph guards stay valid)
STEP_QUERIES = "reasonkv_step_queries"  # a compiled step's keyword argument: {layer: query buffer}


class _Hook:
    """One module's hook: its layer index and callback, held weakly: a bound method as its owner (weakly) and
    its function, a plain function as a weak reference to itself. (Not ``weakref.WeakMethod``, and no bound
    method rebuilt from the function: neither traces on every torch release.) A listener sees no value and
    replaces nothing."""

    __slots__ = ("function", "layer", "listens", "owner")

    def __init__(self, layer: int, callback: Listener | Reader, listens: bool):
        self.layer, self.listens = layer, listens
        bound = hasattr(callback, "__self__")
        self.owner = weakref.ref(callback.__self__ if bound else callback)
        self.function = callback.__func__ if bound else None

    def __call__(self, query, key, value, attention_mask, kwargs):
        owner = self.owner()
        if owner is None:
            return None
        args = (query, key, attention_mask, kwargs) if self.listens else (query, key, value, attention_mask, kwargs)
        answer = owner(self.layer, *args) if self.function is None else self.function(owner, self.layer, *args)
        return None if self.listens else answer


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
        if queries is not None:  # a compiled step: its buffers, no hook
            queries[module.layer_idx].copy_(query)
        else:
            hooks = getattr(module, _HOOKS, None)
            if hooks:  # every hook sees the call as the model made it; the first replacement is attended to
                chosen = None
                for hook in list(hooks.values()):
                    answer = hook(query, key, value, attention_mask, kwargs)
                    chosen = answer if chosen is None else chosen
                if chosen is not None:
                    key, value, attention_mask = chosen
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
    attention implementation is not reasonkv's wrapper and none of its attention modules is hooked (what a
    plain transformers measurement needs)."""
    name = attention_implementation(model)
    registered = ALL_ATTENTION_FUNCTIONS.get(name)
    if name in _installed or any(registered is wrapper for wrapper in _wrappers.values()):
        raise RuntimeError(f"the {name!r} attention kernel is still wrapped by reasonkv's tap")
    claimed = [i for i, module in enumerate(attention_modules(model)) if hasattr(module, _HOOKS)]
    if claimed:
        raise RuntimeError(f"attention modules of layers {claimed} are still claimed by reasonkv's tap")


class _Hooked:
    """Hooks on some attention modules of a model, with the kernel wrapper held, until :meth:`close`."""

    def __init__(self, model: torch.nn.Module, callback, slot, layers=None, *, listens: bool):
        self.name = attention_implementation(model)
        modules = attention_modules(model)
        wanted = set(range(len(modules)) if layers is None else layers)
        self.modules = {i: m for i, m in enumerate(modules) if m is not None and i in wanted}
        if layers is None and not self.modules:
            raise ValueError(f"{type(model).__name__} has no attention module to tap")
        self.slot = slot
        self.hooks = {i: _Hook(i, callback, listens) for i in self.modules}
        _acquire(self.name)
        self._finalizer = weakref.finalize(self, _release, self.name)
        self.claim()

    def claim(self) -> None:
        """(Re)claim the model's attention modules, e.g. after another tap on the same model claimed them.

        Every module is claimed at once, so the first one tells whether they are still this object's: then
        nothing is written (the common case, once per forward)."""
        if not self.modules:
            return
        first = next(iter(self.modules))
        if getattr(self.modules[first], _HOOKS, {}).get(self.slot) is self.hooks[first]:
            return
        for i, module in self.modules.items():
            if not hasattr(module, _HOOKS):
                setattr(module, _HOOKS, {})
            getattr(module, _HOOKS)[self.slot] = self.hooks[i]

    def close(self) -> None:
        """Unhook; unregister the wrapper if this was the last open hook on the kernel."""
        if not self._finalizer.alive:
            return
        for i, module in self.modules.items():
            hooks = getattr(module, _HOOKS, {})
            if hooks.get(self.slot) is self.hooks[i]:
                del hooks[self.slot]
            if not hooks and hasattr(module, _HOOKS):
                delattr(module, _HOOKS)
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AttentionTap(_Hooked):
    """Route the attention calls of ``model`` to ``listener`` (held weakly) until :meth:`close`: the layer index,
    the query and key as the kernel gets them (post-RoPE, cached keys included), the mask and the kernel's
    keyword arguments (``scaling``, ``softcap``, ``s_aux``, ...). A module listens to the tap that claimed it last.
    """

    def __init__(self, model: torch.nn.Module, listener: Listener):
        super().__init__(model, listener, _LISTENER, listens=True)


class KernelReader(_Hooked):
    """Let ``reader`` choose what the attention of ``model``'s full-attention layers reads, until :meth:`close`.

    For every attention call of a module in ``layers``, ``reader(layer, query, key, value, mask, kwargs)`` returns
    None (read everything) or the ``(key, value, additive mask [batch, heads, q, n])`` the model's own kernel
    attends to instead. Held weakly, like a tap's listener; a compiled step does not call it.
    """

    def __init__(self, model: torch.nn.Module, reader: Reader, layers: Iterator[int] | None = None):
        check_readable(model, "a selection policy reads chosen blocks")
        super().__init__(model, reader, object(), layers, listens=False)


def check_readable(model: torch.nn.Module, reads: str) -> None:
    """``ValueError`` unless ``model`` runs a kernel a :class:`KernelReader` can steer; ``reads``: what for."""
    name = attention_implementation(model)
    if name not in ("sdpa", "eager"):
        raise ValueError(
            f"{reads} through the sdpa or eager attention kernel; this model runs {name!r}: load it with "
            "attn_implementation='sdpa'"
        )
