"""Per-token signals of one teacher-forced pass, averaged per chunk.

One forward over prompt + trace records, for every decoder layer ``l`` (counted from 0):

``g``
    ``g_l(t) = ||h_l(t) - h_l(t-1)||_2``, ``h_l`` the output of decoder layer ``l`` read with a
    forward hook (not ``output_hidden_states``, whose last entry is the final-normed state in
    transformers 5); ``NaN`` at position 0.
``z``
    EPIKV's causal rolling z-score of ``g_l``: mean and population standard deviation of the
    defined ``g_l`` at the previous ``window`` positions, ``z = (g - mu) / (sigma + eps)``, 0 where
    fewer than two are defined.

and the per-token scores of the baselines that can be read off the same pass (higher = keep),
averaged over every full-attention layer (every layer of a plain model: the layers these policies
read and evict) and every head, so that each is one number per token:

``knorm``
    minus the key norm (the knorm policy keeps low-norm keys).
``h2o``
    attention each key received, summed over every query of the sequence (H2O's accumulated score
    at the end of the trace).
``tova``
    attention of the last query of the sequence (TOVA's score at the end of the trace).
``snapkv``
    attention of the last ``query_window`` queries, summed, averaged over the query heads of each
    kv group and pooled along the positions (``kernel``, ``pooling``), as the snapkv policy does.
``recency``
    the position itself (what a sliding window keeps), a reference for position effects.
``random``
    uniform noise seeded by the trace id, the chance reference.

Attention probabilities come from this offline pass only (analysis, not decoding): a probe listens
on the attention tap (:class:`reasonkv.hf.AttentionTap`), recomputes each layer's softmax attention
from the post-RoPE queries and keys with the same additive mask the labels use (learned attention
sinks and soft-capping included) and reduces it to the scores above, while the model's own kernel
runs as usual. ``g`` and ``z`` cover every decoder layer, as EPIKV's layers do.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from reasonkv.calibrate.labels import MASKED_IMPLEMENTATIONS, attention_masks
from reasonkv.hf import AttentionTap, attention_implementation, decoder_layers, model_info
from reasonkv.runs.flags import setting

__all__ = [
    "BASELINE_SCORES",
    "SignalSettings",
    "causal_zscore",
    "chunk_means",
    "step_distances",
    "token_signals",
    "trace_signals",
]

BASELINE_SCORES = ("knorm", "h2o", "tova", "snapkv", "recency", "random")
_POOLINGS = ("max", "avg")


@dataclass(frozen=True)
class SignalSettings:
    """Options of the per-token signals.

    Parameters
    ----------
    window : int
        ``W`` of EPIKV's rolling z-score (default 128, EPIKV's default).
    eps : float
        Added to the rolling standard deviation (default 1e-6, EPIKV's).
    query_window : int
        SnapKV's observation window (default 32, the snapkv policy's).
    kernel : int
        SnapKV's pooling width (default 7; odd; 1 = none).
    pooling : {"max", "avg"}
        SnapKV's pooling (default "max", the snapkv policy's).
    """

    window: int = setting(128, group="signals", type="positive", help="EPIKV z-score window W (default 128)")
    eps: float = 1e-6
    query_window: int = setting(32, group="signals", type="positive", help="SnapKV window (default 32)")
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        for name in ("window", "query_window", "kernel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd, got {self.kernel}")
        if not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not self.eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {self.eps!r}")
        if self.pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(_POOLINGS)}, got {self.pooling!r}")

    def record_settings(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- pure maths


def step_distances(hidden: torch.Tensor) -> torch.Tensor:
    """``[T, dim] -> [T]``: ``||h(t) - h(t-1)||_2`` in float32, ``NaN`` at ``t = 0``."""
    hidden = hidden.float()
    g = torch.full((hidden.shape[0],), math.nan, dtype=torch.float32, device=hidden.device)
    g[1:] = torch.linalg.vector_norm(hidden[1:] - hidden[:-1], dim=-1)
    return g


def causal_zscore(g: torch.Tensor, window: int, eps: float = 1e-6) -> torch.Tensor:
    """EPIKV's rolling z-score along the last axis of ``g`` (``NaN`` = missing).

    ``z(t) = (g(t) - mu) / (sigma + eps)`` with ``mu``, ``sigma`` the mean and population standard
    deviation of the defined values among ``g(t - window) .. g(t - 1)``; 0 where ``g(t)`` is
    missing or fewer than two values are defined. Computed with running sums in float64.
    """
    defined = ~g.isnan()
    x = torch.where(defined, g, 0.0).double()
    n = defined.double()
    zero = x.new_zeros((*x.shape[:-1], 1))
    sums = [torch.cat([zero, v.cumsum(-1)], -1) for v in (x, x * x, n)]  # sums[k][t] = sum over < t
    length = g.shape[-1]
    hi = torch.arange(length, device=g.device)
    lo = (hi - window).clamp(min=0)
    s1, s2, count = (s[..., hi] - s[..., lo] for s in sums)
    mu = s1 / count.clamp(min=1)
    sigma = (s2 / count.clamp(min=1) - mu * mu).clamp(min=0).sqrt()
    z = (x - mu) / (sigma + eps)
    return torch.where(defined & (count >= 2), z, 0.0).float()


def chunk_means(values: torch.Tensor, chunks: list[tuple[int, int]] | list[list[int]]) -> torch.Tensor:
    """Mean over each chunk's positions along the last axis, ignoring ``NaN``: ``[..., T] -> [..., chunks]``."""
    out = []
    for start, end in chunks:
        part = values[..., start:end]
        defined = ~part.isnan()
        total = torch.where(defined, part, 0.0).sum(-1)
        out.append(total / defined.sum(-1))  # 0/0 = NaN for a chunk with nothing defined
    return torch.stack(out, -1)


def _pool(scores: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Same-length pooling along the last axis of ``[heads, T]`` (edges see fewer neighbours)."""
    if kernel <= 1:
        return scores
    flat = scores.unsqueeze(1)
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return pooled.squeeze(1)


# --------------------------------------------------------------------------- the probe


class _Probe:
    """Tap listener that reduces the attention probabilities of each layer to the baseline scores.

    Only the full-attention layers count, the ones those policies read and evict on a hybrid model;
    learned attention sinks and soft-capping enter the softmax as in the model's kernel.
    """

    def __init__(self, settings: SignalSettings, full_layers: tuple[int, ...]):
        self.settings = settings
        self.full_layers = full_layers
        self.per_layer: dict[str, dict[int, torch.Tensor]] = {name: {} for name in ("knorm", "h2o", "tova", "snapkv")}

    def __call__(self, layer: int, query, key, attention_mask, kwargs: dict) -> None:
        if layer not in self.full_layers:
            return
        _, hq, _, dim = query.shape
        hkv = key.shape[1]
        groups = hq // hkv
        scaling = kwargs.get("scaling") or dim**-0.5
        keys = key.float().repeat_interleave(groups, dim=1)
        logits = torch.matmul(query.float(), keys.transpose(-1, -2)) * scaling
        softcap = kwargs.get("softcap")
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                logits = logits.masked_fill(~attention_mask, float("-inf"))
            else:
                logits = logits + attention_mask.float()
        sinks = kwargs.get("s_aux", kwargs.get("sinks"))
        if sinks is None:
            probs = logits.softmax(-1)  # [1, Hq, T, T]
        else:  # one more logit per head shares the softmax, then is dropped
            sink = sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
            probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]

        p = probs[0]
        s = self.settings
        self.per_layer["knorm"][layer] = -torch.linalg.vector_norm(key[0].float(), dim=-1).mean(0)
        self.per_layer["h2o"][layer] = p.sum(1).mean(0)
        self.per_layer["tova"][layer] = p[:, -1].mean(0)
        window = p[:, -s.query_window :].sum(1)  # [Hq, T]
        grouped = window.view(hkv, groups, -1).mean(1)
        self.per_layer["snapkv"][layer] = _pool(grouped, s.kernel, s.pooling).mean(0)


@torch.inference_mode()
def token_signals(
    model: Any, ids: list[int] | torch.Tensor, settings: SignalSettings | None = None, *, seed_key: str = ""
):
    """Per-token ``g``, ``z`` (``[layers, T]``) and baseline scores (``[T]`` each) of one sequence.

    ``seed_key`` seeds the ``random`` score (the trace id, so a trace always gets the same noise).
    """
    settings = settings or SignalSettings()
    implementation = attention_implementation(model)
    if implementation not in MASKED_IMPLEMENTATIONS:
        raise ValueError(
            f"token signals need an attention implementation that applies an arbitrary mask "
            f"({', '.join(MASKED_IMPLEMENTATIONS)}); the model uses {implementation!r}"
        )
    device = next(model.parameters()).device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(-1)
    total = ids.shape[0]
    layers = decoder_layers(model)
    hidden: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def record(module, args, output):
            hidden[index] = (output[0] if isinstance(output, tuple) else output)[0]

        return record

    probe = _Probe(settings, model_info(model).full_layers)
    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    dtype = next(model.parameters()).dtype
    positions = torch.arange(total, device=device)
    try:
        with AttentionTap(model, probe):
            mask = attention_masks(model, positions, total, [None], dtype)
            model(input_ids=ids.unsqueeze(0), attention_mask=mask, position_ids=positions.unsqueeze(0), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    g = torch.stack([step_distances(hidden[i]) for i in range(len(layers))])
    z = causal_zscore(g, settings.window, settings.eps)
    scores = {name: torch.stack(list(values.values())).mean(0).float() for name, values in probe.per_layer.items()}
    scores["recency"] = positions.float()
    generator = torch.Generator().manual_seed(zlib.crc32(seed_key.encode()))
    scores["random"] = torch.rand(total, generator=generator).to(device)
    return {"g": g, "z": z, "scores": scores}


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
