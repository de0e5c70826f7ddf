"""Compiled decode: each decode step one fixed-shape graph, the eviction between steps.

A small batch's decode step is bound by kernel launches and Python. :class:`CompiledDecode` runs the
single-token forward through ``torch.compile`` (CUDA graphs on a GPU) over the cache's
:class:`~reasonkv.cache.static.StaticLayout` (the same tensors at the same shapes at every step). What changes
shape stays eager between steps, as without compiling: the evictor's bookkeeping, scoring and gather
(:meth:`Evictor.announce <reasonkv.cache.evictor.Evictor.announce>`, :meth:`Evictor.finish`), and the signals,
which the step writes into fixed buffers (:class:`~reasonkv.hf.capture.StepCapture`) for the observer to record
after it. So a run that evicts hundreds of times compiles once per (batch, capacity). The capture's hooks and
kernel wrapper are removed by :meth:`CompiledDecode.close`: after a run no model passes through reasonkv code.

Caches without a fixed-shape layout decode eagerly (:attr:`CompiledDecode.eager_reason` says why); a selection
policy is refused (:meth:`CacheSpec.check_compile <reasonkv.cache.spec.CacheSpec.check_compile>`).
:class:`StaticStep` is the same graph over transformers' ``StaticCache``, the plain reference."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from contextlib import ExitStack, contextmanager

import torch
from torch._dynamo.utils import counters

from reasonkv.cache.evicting import EvictingCache
from reasonkv.cache.static import StaticLayout, static_blocker
from reasonkv.hf import Forward, StepCapture, static_cache, synchronize

__all__ = [
    "GRAPH_LIMITS",
    "CompiledDecode",
    "StaticStep",
    "compile_backend",
    "compile_mode",
    "compiled_function",
]


def compile_backend(compile: bool | str) -> str | None:
    """The ``torch.compile`` backend that ``compile=`` asks for: None (eager), ``inductor`` for True, or
    the backend named."""
    if compile is False:
        return None
    if compile is True:
        return "inductor"
    backends = torch._dynamo.list_backends(exclude_tags=())
    if isinstance(compile, str) and compile in backends:
        return compile
    raise ValueError(f"compile must be True, False or a torch.compile backend ({', '.join(backends)}), got {compile!r}")


def compile_mode(device: torch.device, backend: str = "inductor") -> str | None:
    """``torch.compile``'s mode for ``backend`` on ``device``: CUDA graphs on a GPU (``reduce-overhead``), the
    default on a CPU; none for backends other than inductor, whose modes they are."""
    return "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None


# A compiled function holds a graph per (model, batch size, capacity, hooks) over every run: more than
# torch's default of 8. Past this many it fails rather than silently running eager.
GRAPH_LIMITS = torch._dynamo.config.patch(recompile_limit=256, fail_on_recompile_limit_hit=True)


@contextmanager
def _no_collection():
    """No cyclic garbage collection while a step may be traced: collecting a freed model's attention tap
    registers the original kernel back, which must not happen under a graph being traced (dynamo fails)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_compiled: dict[tuple, object] = {}  # (function, backend, mode) -> its compiled wrapper, one per process


def compiled_function(function, backend: str, mode: str | None):
    """``function`` compiled (whole graph, static shapes) once per process: its traced graphs are reused from
    one run to the next (guarded by the model and the shapes), instead of each run tracing its own."""
    key = (function, backend, mode)
    if key not in _compiled:
        _compiled[key] = torch.compile(function, fullgraph=True, dynamic=False, backend=backend, mode=mode)
    return _compiled[key]


def traced_step_logits(model, cache_key: str, input_ids, position_ids, attention_mask, cache, capture: dict):
    """The single-token forward a compiled step holds (:class:`CompiledDecode` and :class:`StaticStep`): the
    newest logits ``[batch, vocab]``. ``model.forward``, not ``model(...)``: the evictor's hooks on the model run
    between steps, not inside the graph; the layers write their signals into the buffers of ``capture``."""
    inputs = {cache_key: cache, "position_ids": position_ids, "attention_mask": attention_mask, **capture}
    return model.forward(input_ids=input_ids, use_cache=True, logits_to_keep=1, **inputs).logits[:, -1]


class _GraphSteps:
    """What both compiled steps hold (the model's forward, the backend and its mode) and report: the graphs
    traced, the seconds the steps that traced one took (their warm-up), and what ran."""

    eager_reason: str | None = None

    def __init__(self, model, backend: str, mode: str | None):
        self.model, self.backend = model, backend
        self.device = next(model.parameters()).device
        self.mode = compile_mode(self.device, backend) if mode is None else mode
        self._forward = Forward(model)
        self.compilations, self.warmup_seconds = 0, 0.0

    def _replay(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One step of the compiled graph, ``call()``: its logits (a copy under CUDA graphs, whose output the next
        replay overwrites); a step that traced a graph counts it, and its seconds as warm-up."""
        graphs, started = counters["stats"]["unique_graphs"], time.perf_counter()
        with GRAPH_LIMITS, _no_collection():
            logits = call()
        if counters["stats"]["unique_graphs"] != graphs:  # this call traced and compiled a graph
            synchronize(self.device)
            self.compilations += counters["stats"]["unique_graphs"] - graphs
            self.warmup_seconds += time.perf_counter() - started
        return logits.clone() if self.mode == "reduce-overhead" else logits

    def describe(self) -> dict:
        """What ran, for a run's statistics."""
        return {
            "compiled": self.compiled,
            "backend": self.backend if self.compiled else None,
            "mode": self.mode if self.compiled else None,
            "compilations": self.compilations,
            "warmup_seconds": self.warmup_seconds,
            "eager_reason": self.eager_reason,
        }


class CompiledDecode(_GraphSteps):
    """The decode steps of ``model`` with its attached ``cache`` (an :class:`~reasonkv.cache.EvictingCache` that has
    seen the prompt), compiled with ``backend`` (default ``inductor``) and ``mode`` (default :func:`compile_mode`).

    Called with a step's ``[batch, 1]`` ids and padding mask (None: every row live), it returns the newest
    logits ``[batch, vocab]``; the cache evicts after it as after an eager forward. :attr:`compilations` counts
    the graphs traced, :attr:`warmup_seconds` the time the steps that traced one took."""

    def __init__(self, model, cache: EvictingCache, *, backend: str = "inductor", mode: str | None = None):
        if cache.evictor is None:
            raise ValueError("CompiledDecode needs an EvictingCache attached to the model (built with model=...)")
        cache.spec.check_compile()
        super().__init__(model, backend, mode)
        self.cache, self.dtype = cache, next(model.parameters()).dtype
        self.eager_reason = static_blocker(cache)
        capture = StepCapture.of(model) if self.eager_reason is None else None
        if capture is not None and capture.blocker is not None:
            self.eager_reason, capture = capture.blocker, None
        self._layout = None if self.eager_reason is not None else StaticLayout(cache)
        self._graph = None if self.eager_reason else compiled_function(traced_step_logits, backend, self.mode)
        self._capture = capture
        self._running = False  # whether the capture's hooks and kernel wrapper are installed
        self._installed = ExitStack()
        weakref.finalize(self, self._installed.close)  # a decoder dropped without close() removes them too

    @property
    def compiled(self) -> bool:
        return self.eager_reason is None

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt's forward, eager (any number of tokens a row): its newest logits."""
        return self._forward.newest_logits(input_ids, self.cache, attention_mask)

    def close(self) -> None:
        """Remove the capture's hooks and kernel wrapper (the run is over; calling again is harmless)."""
        self._installed.close()
        self._running = False

    def __enter__(self) -> CompiledDecode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.shape[1] != 1:
            raise ValueError(f"a compiled decode step takes one token per row, got {input_ids.shape[1]}")
        if not self.compiled:
            return self.prefill(input_ids, attention_mask)
        evictor, batch = self.cache.evictor, input_ids.shape[0]
        incoming = None if attention_mask is None else attention_mask[:, -1:].to(dtype=torch.bool)
        announced = evictor.announce(batch, 1, incoming, input_ids.device)
        info = evictor.info
        capture = self._capture
        capture.allocate(batch, info.num_heads, info.head_dim, self.dtype, self.device)
        if not self._running:
            self._installed.enter_context(capture.open())
            self._running = True
        cache, mask = self._layout.open_step()
        inputs = (self.model, self._forward.cache_key, input_ids, announced.positions, mask, cache)
        logits = self._replay(lambda: self._graph(*inputs, capture.step_inputs()))
        self._layout.close_step(announced.step_positions)
        evictor.observe(announced, self._capture)
        evictor.finish()
        return logits


class StaticStep(_GraphSteps):
    """Plain transformers decoding compiled: a ``StaticCache`` of ``capacity`` slots a row, the prefill eager and
    each single-token step through ``torch.compile`` of the model's forward (CUDA graphs on a GPU). No reasonkv
    code runs on the model (its :attr:`cache` is transformers' own)."""

    compiled = True

    def __init__(self, model, capacity: int, *, backend: str):
        super().__init__(model, backend, None)
        self.cache = static_cache(model, capacity)
        self._graph = compiled_function(traced_step_logits, backend, self.mode)
        self._length = 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("transformers' static cache is decoded with rows in step (no padding mask)")
        self._length += input_ids.shape[1]
        return self._forward.newest_logits(input_ids, self.cache)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("transformers' static cache is decoded with rows in step (no padding mask)")
        positions = torch.full((input_ids.shape[0], 1), self._length, dtype=torch.long, device=self.device)
        logits = self._replay(
            lambda: self._graph(self.model, self._forward.cache_key, input_ids, positions, None, self.cache, {})
        )
        self._length += 1
        return logits

    def close(self) -> None:
        pass
