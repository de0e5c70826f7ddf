"""Counterfactual importance labels: how much hiding a chunk of the trace hurts what follows.

Hiding chunk ``[s, e)`` forbids every query at a position ``>= e`` to attend to its keys, through a 4-D additive
attention mask (positions never move); the labels ``later``, ``later_sum`` and ``answer`` are the drops in the
teacher-forced log-likelihood of what follows (definitions: docs/calibrate.md). The full pass's cache is reused
for the prefix before a chunk's end, and ``batch_size`` chunks are hidden at once, one per batch row.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from reasonkv.calibrate.shared import check_positive
from reasonkv.calibrate.traces import Trace
from reasonkv.hf import Forward, attention_implementation, cached_kv, masks_per_layer_type, plain_cache
from reasonkv.runs.flags import setting
from reasonkv.suggest.integers import is_int

__all__ = [
    "MASKED_IMPLEMENTATIONS",
    "LabelSettings",
    "TARGETS",
    "attention_masks",
    "check_masked",
    "chunk_bounds",
    "label_trace",
    "occlusion_mask",
    "token_logprobs",
]

#: The label kinds every record holds.
TARGETS = ("later", "later_sum", "answer")
#: Attention implementations that honour a 4-D additive mask (FlashAttention kernels take none).
MASKED_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class LabelSettings:
    """Options of the occlusion labels: ``chunk_size`` tokens hidden at once (8: a GSM8K reference solution of
    ~100 tokens gives ~12 chunks, enough to rank within a trace), the ``horizon`` of trace tokens scored after a
    chunk (None: all), and ``batch_size`` chunks hidden per forward (memory grows with it; results do not)."""

    chunk_size: int = setting(8, group="labels", type="positive", help="tokens hidden at once (default 8)")
    horizon: int | None = setting(
        None, group="labels", type="positive or all", help="score only this many tokens after a chunk (default: all)"
    )
    batch_size: int = setting(8, group="labels", type="positive", help="chunks hidden per forward (default 8)")

    def __post_init__(self) -> None:
        check_positive(self, "chunk_size", "batch_size")
        if self.horizon is not None and (not is_int(self.horizon) or self.horizon < 1):
            raise ValueError(f"horizon must be a positive integer or None, got {self.horizon!r}")

    def record_settings(self) -> dict[str, Any]:
        """The settings that change the labels (``batch_size`` does not)."""
        return {name: value for name, value in asdict(self).items() if name != "batch_size"}


def chunk_bounds(prompt_length: int, total_length: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` positions of the trace chunks (the last one may be shorter)."""
    return [(s, min(s + chunk_size, total_length)) for s in range(prompt_length, total_length, chunk_size)]


# --------------------------------------------------------------------------- masks


def check_masked(model: Any, what: str) -> None:
    """Refuse a model whose attention implementation ignores an arbitrary mask (``what`` needs one)."""
    implementation = attention_implementation(model)
    if implementation not in MASKED_IMPLEMENTATIONS:
        raise ValueError(
            f"{what} need an attention implementation that applies an arbitrary mask "
            f"({', '.join(MASKED_IMPLEMENTATIONS)}); the model uses {implementation!r}"
        )


def occlusion_mask(
    query_positions: torch.Tensor,
    key_length: int,
    hidden: list[tuple[int, int] | None],
    *,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """Additive mask ``[len(hidden), 1, q, key_length]``: causal, minus one hidden chunk per row.

    Row ``b`` hides keys ``hidden[b] = (s, e)`` from queries at positions ``>= e`` (``None``: hide
    nothing). ``window`` adds a sliding window (a query sees the ``window`` most recent keys,
    itself included). Allowed entries are 0, forbidden ones the dtype's most negative value.
    """
    device = query_positions.device
    keys = torch.arange(key_length, device=device)
    q = query_positions.view(1, 1, -1, 1)
    k = keys.view(1, 1, 1, -1)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    starts = torch.tensor([h[0] if h else 0 for h in hidden], device=device).view(-1, 1, 1, 1)
    ends = torch.tensor([h[1] if h else 0 for h in hidden], device=device).view(-1, 1, 1, 1)
    blocked = (k >= starts) & (k < ends) & (q >= ends)
    allowed = allowed & ~blocked
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def attention_masks(
    model: Any, query_positions: torch.Tensor, key_length: int, hidden: list[tuple[int, int] | None], dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """:func:`occlusion_mask` in the form the model takes: one tensor, or one per layer type when the
    config lists ``layer_types`` (sliding-window layers then get their window)."""
    return masks_per_layer_type(
        model, lambda window: occlusion_mask(query_positions, key_length, hidden, dtype=dtype, window=window)
    )


# --------------------------------------------------------------------------- forwards


def token_logprobs(
    model: Any,
    ids: torch.Tensor,
    start: int,
    hidden: list[tuple[int, int] | None],
    prefix_cache: Any | None = None,
    *,
    keep_cache: bool = False,
) -> tuple[torch.Tensor, Any]:
    """``log p(x_t | x_<t)`` for ``t in [start + 1, T)`` of ``ids`` ``[T]``, one row per entry of ``hidden``:
    ``([len(hidden), T - start - 1] float32, cache)``, this forward's cache only with ``keep_cache``. Positions
    ``< start`` come from ``prefix_cache`` (the unhidden sequence's, required when ``start > 0``; left untouched)."""
    check_masked(model, "occlusion labels")
    total = ids.shape[0]
    rows = len(hidden)
    device = ids.device
    # Every layer keeps every key, so prefixes can be copied between caches as they are; sliding
    # windows are applied by the masks instead.
    cache = plain_cache()
    if start > 0:
        if prefix_cache is None:
            raise ValueError("start > 0 needs the prefix cache of the unhidden sequence")
        for layer in range(len(prefix_cache.layers)):
            keys, values = cached_kv(prefix_cache, layer)
            cache.update(
                keys[:1, :, :start].expand(rows, -1, -1, -1), values[:1, :, :start].expand(rows, -1, -1, -1), layer
            )
    inputs = ids[start:].unsqueeze(0).expand(rows, -1)
    positions = torch.arange(start, total, device=device)
    dtype = next(model.parameters()).dtype
    mask = attention_masks(model, positions, total, hidden, dtype)
    out = Forward(model)(inputs, cache, attention_mask=mask, position_ids=positions.unsqueeze(0).expand(rows, -1))
    logits = out.logits[:, :-1].float()
    targets = inputs[:, 1:]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logprobs, (cache if keep_cache else None)


@torch.inference_mode()
def label_trace(model: Any, trace: Trace, settings: LabelSettings | None = None) -> dict[str, Any]:
    """Occlusion labels of one trace: ``chunks`` (``[start, end)`` logical positions), ``labels`` (one float per
    chunk of each of ``TARGETS``, ``nan`` where undefined), ``scored`` (``later`` targets per chunk),
    ``answer_positions`` (``[start, end)`` or None), ``full_logprob`` (under the full context: the trace tokens'
    mean, the answer's sum) and ``seconds``."""
    settings = settings or LabelSettings()
    started = time.perf_counter()
    device = next(model.parameters()).device
    ids = torch.tensor(trace.ids, dtype=torch.long, device=device)
    total, prompt = ids.shape[0], trace.prompt_length
    chunks = chunk_bounds(prompt, total, settings.chunk_size)
    answer = None if trace.answer_span is None else (prompt + trace.answer_span[0], prompt + trace.answer_span[1])

    full, full_cache = token_logprobs(model, ids, 0, [None], keep_cache=True)
    full = full[0]  # full[t - 1] = lp(t)

    later = [math.nan] * len(chunks)
    later_sum = [math.nan] * len(chunks)
    answer_drop = [math.nan] * len(chunks)
    scored = [0] * len(chunks)
    for first in range(0, len(chunks), settings.batch_size):
        group = list(range(first, min(first + settings.batch_size, len(chunks))))
        start = chunks[group[0]][1]  # no query before the first chunk's end is affected
        if start + 1 >= total:
            continue  # only the last chunk, which has nothing after it
        hidden_lp, _ = token_logprobs(model, ids, start, [chunks[c] for c in group], full_cache)
        drops = full[start:].unsqueeze(0) - hidden_lp  # drops[:, j] is target t = start + 1 + j
        for row, c in enumerate(group):
            end = chunks[c][1]
            stop = total if settings.horizon is None else min(total, end + 1 + settings.horizon)
            if end + 1 < stop:
                window = drops[row, end - start : stop - start - 1]
                later_sum[c] = float(window.sum())
                later[c] = later_sum[c] / window.numel()
                scored[c] = window.numel()
            if answer is not None and answer[0] - 1 >= end:
                answer_drop[c] = float(drops[row, answer[0] - start - 1 : answer[1] - start - 1].sum())
    return {
        "chunks": [list(c) for c in chunks],
        "labels": {"later": later, "later_sum": later_sum, "answer": answer_drop},
        "scored": scored,
        "answer_positions": None if answer is None else list(answer),
        "full_logprob": {
            "trace_mean": float(full[prompt - 1 :].mean()),
            "answer": math.nan if answer is None else float(full[answer[0] - 1 : answer[1] - 1].sum()),
        },
        "seconds": time.perf_counter() - started,
    }
