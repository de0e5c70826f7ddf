"""Per-token signals of one teacher-forced pass, averaged per chunk (definitions: docs/calibrate.md).

``g`` (each decoder layer's hidden-state step, read with a forward hook) and ``z`` (EPIKV's causal rolling
z-score of it), and the baselines' scores (``knorm``, ``h2o``, ``tova``, ``snapkv``, averaged over the
full-attention layers and heads; ``recency``, ``random``). Every score is its policy's own function
(:mod:`reasonkv.policies.epikv_signal`, :mod:`~reasonkv.policies.knorm`, :mod:`~reasonkv.policies.h2o`,
:mod:`~reasonkv.policies.tova`, :mod:`~reasonkv.policies.snapkv`) over the whole sequence, on attention a probe on
the attention tap recomputes from the post-RoPE queries and keys (:mod:`reasonkv.policies.attention`) while the
model's own kernel runs.
"""

from __future__ import annotations

import functools
import math
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from reasonkv.calibrate.labels import attention_masks, check_masked
from reasonkv.calibrate.shared import check_positive
from reasonkv.hf import AttentionTap, decoder_layers, model_info
from reasonkv.policies import attention
from reasonkv.policies.epikv_signal import rolling_zscore, step_distances, window_mean
from reasonkv.policies.h2o import received_attention
from reasonkv.policies.knorm import key_norm_scores
from reasonkv.policies.snapkv import POOLINGS, pooled_window_scores
from reasonkv.policies.tova import newest_query_scores
from reasonkv.runs.flags import setting
from reasonkv.suggest.integers import is_number

__all__ = [
    "BASELINE_SCORES",
    "SIGNALS",
    "SignalSettings",
    "causal_zscore",
    "chunk_means",
    "token_signals",
    "trace_signals",
]

BASELINE_SCORES = ("knorm", "h2o", "tova", "snapkv", "recency", "random")
SIGNALS = ("z", "g")  # the per-layer signals a band can be picked by


@dataclass(frozen=True)
class SignalSettings:
    """Options of the per-token signals: EPIKV's z-score ``window`` and ``eps`` (its defaults), SnapKV's
    ``query_window``, ``kernel`` (odd; 1: none) and ``pooling`` (the snapkv policy's defaults)."""

    window: int = setting(128, group="signals", type="positive", help="EPIKV z-score window W (default 128)")
    eps: float = 1e-6
    query_window: int = setting(32, group="signals", type="positive", help="SnapKV window (default 32)")
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        check_positive(self, "window", "query_window", "kernel")
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd, got {self.kernel}")
        if not is_number(self.eps) or not self.eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {self.eps!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")


# --------------------------------------------------------------------------- over a whole sequence


def causal_zscore(g: torch.Tensor, window: int, eps: float = 1e-6) -> torch.Tensor:
    """EPIKV's rolling z-score along the last axis of ``g`` (``NaN``: missing), the policy's own
    (:func:`~reasonkv.policies.epikv_signal.rolling_zscore`) against each position's ``window`` previous values;
    in float64, one row at a time (a row's windows are a view; the statistics are ``window`` times its length)."""
    rows = g.reshape(-1, g.shape[-1]).double()
    z = []
    for row in rows:
        history = F.pad(row, (window, 0), value=math.nan).unfold(0, window, 1)[:-1]  # [T, window]
        z.append(rolling_zscore(row, history, eps))
    return torch.stack(z).float().view(g.shape)


def chunk_means(values: torch.Tensor, chunks: list[tuple[int, int]] | list[list[int]]) -> torch.Tensor:
    """Mean over each chunk's positions along the last axis, ignoring ``NaN``: ``[..., T] -> [..., chunks]``
    (``NaN`` for a chunk with nothing defined)."""
    return torch.stack([window_mean(values[..., start:end]) for start, end in chunks], -1)


def _layer_scores(query, key, kwargs: dict, settings: SignalSettings) -> dict[str, torch.Tensor]:
    """The baseline scores (``[T]`` each, averaged over the kv heads) of one full-attention layer's post-RoPE
    ``query`` ``[1, Hq, T, D]`` and ``key`` ``[1, Hkv, T, D]`` (learned sinks and soft-capping from ``kwargs``)."""
    _, kv_heads, length, _ = key.shape
    kernel = attention.Kernel.of(query, kwargs)
    every = torch.ones(1, length, dtype=torch.bool, device=key.device)
    w = min(settings.query_window, length)
    recent = torch.arange(length - w, length, device=key.device).view(1, w)
    slots = torch.arange(length, device=key.device).expand(1, kv_heads, length)
    window = attention.window_attention(query[:, :, -w:], recent, every[:, -w:], key, slots, every, kernel)
    scores = {
        "knorm": key_norm_scores(key),
        "h2o": received_attention(attention.column_sums(query, key, every, every, kernel), kv_heads),
        "tova": newest_query_scores(attention.newest_row(query[:, :, -1:], key, every, kernel), kv_heads),
        "snapkv": pooled_window_scores(window, every, kv_heads, kernel=settings.kernel, pooling=settings.pooling),
    }
    return {name: value[0].mean(0) for name, value in scores.items()}


@torch.inference_mode()
def token_signals(
    model: Any, ids: list[int] | torch.Tensor, settings: SignalSettings | None = None, *, seed_key: str = ""
):
    """Per-token ``g``, ``z`` (``[layers, T]``) and baseline scores (``[T]`` each) of one sequence; ``seed_key``
    (the trace id) seeds the ``random`` score, so a trace always gets the same noise."""
    settings = settings or SignalSettings()
    check_masked(model, "token signals")
    device = next(model.parameters()).device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(-1)
    total = ids.shape[0]
    layers = decoder_layers(model)
    hidden: dict[int, torch.Tensor] = {}

    def record(index: int, module, args, output) -> None:
        hidden[index] = (output[0] if isinstance(output, tuple) else output)[0]

    full_layers = model_info(model).full_layers
    per_layer: dict[int, dict[str, torch.Tensor]] = {}

    def probe(layer: int, query, key, mask, kwargs: dict) -> None:
        if layer in full_layers:  # the layers these policies read and evict on a hybrid model
            per_layer[layer] = _layer_scores(query, key, kwargs, settings)

    handles = [layer.register_forward_hook(functools.partial(record, i)) for i, layer in enumerate(layers)]
    dtype = next(model.parameters()).dtype
    positions = torch.arange(total, device=device)
    try:
        with AttentionTap(model, probe):
            mask = attention_masks(model, positions, total, [None], dtype)
            model(input_ids=ids.unsqueeze(0), attention_mask=mask, position_ids=positions.unsqueeze(0), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    g = torch.stack([_step_distances(hidden[i]) for i in range(len(layers))])
    z = causal_zscore(g, settings.window, settings.eps)
    scores = {name: torch.stack([s[name] for s in per_layer.values()]).mean(0).float() for name in BASELINE_SCORES[:4]}
    scores["recency"] = positions.float()
    generator = torch.Generator().manual_seed(zlib.crc32(seed_key.encode()))
    scores["random"] = torch.rand(total, generator=generator).to(device)
    return {"g": g, "z": z, "scores": scores}


def _step_distances(hidden: torch.Tensor) -> torch.Tensor:
    """EPIKV's ``g`` (the policy's own) of one layer's outputs ``[T, dim]`` from the sequence's start: ``[T]``,
    ``NaN`` at 0."""
    length, dim = hidden.shape
    valid = torch.ones(1, length, dtype=torch.bool, device=hidden.device)
    start = torch.zeros(1, dtype=torch.bool, device=hidden.device)  # no token before the first
    return step_distances(hidden.unsqueeze(0), valid, hidden.new_zeros((1, dim), dtype=torch.float32), start)[0][0]


def trace_signals(
    model: Any, ids: list[int], chunks: list[list[int]], settings: SignalSettings | None = None, *, seed_key: str = ""
) -> dict[str, Any]:
    """Chunk means of :func:`token_signals`: ``g``/``z`` as ``[layers][chunks]`` lists, ``scores`` per name
    (six significant digits), and the ``seconds`` it took."""
    started = time.perf_counter()
    signals = token_signals(model, ids, settings, seed_key=seed_key)
    return {
        "g": _rounded(chunk_means(signals["g"], chunks)),
        "z": _rounded(chunk_means(signals["z"], chunks)),
        "scores": {name: _rounded(chunk_means(v, chunks)) for name, v in signals["scores"].items()},
        "seconds": time.perf_counter() - started,
    }


def _rounded(values: torch.Tensor, digits: int = 6) -> list:
    """Nested lists of floats with ``digits`` significant digits (ample for ranks; keeps the files small)."""
    if values.dim() == 0:
        return float(f"{float(values):.{digits}g}")
    return [_rounded(v, digits) for v in values]
