"""Detect degenerate generations (empty output, a token loop at the end, running out of tokens) and outputs
that stopped by themselves without an answer.

A *tail loop* of period ``n`` covers the last ``L + n`` tokens when each of the last ``L`` equals the token
``n`` before it. It counts as repetition when it repeats at least ``min_repeats`` times and spans at least
``min_span`` tokens: the span floor spares short legitimate runs (``0 & 0 & 0``), the repeat floor a phrase
said twice (defaults 64 and 4: one token 64 times, a 64-token paragraph 4 times).

An output that ends by itself before any answer is no collapse but no success either (``early_stop``,
counted apart), or a policy that makes the model stop early would beat the full cache's collapse rate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from reasonkv.eval.extraction import extract_answer

__all__ = ["FLAGS", "collapse_flags", "stopped_early", "tail_loop"]

FLAGS = ("empty", "no_answer", "repetition", "max_tokens", "collapsed", "early_stop")


def _tail_spans(ids: np.ndarray, max_period: int) -> list[tuple[int, int]]:
    """``(period, span)`` for every period with a loop at the end, shortest period first."""
    spans = []
    for n in range(1, min(max_period, len(ids) - 1) + 1):
        same = ids[n:] == ids[:-n]
        misses = np.flatnonzero(~same)
        run = len(same) - 1 - int(misses[-1]) if len(misses) else len(same)  # trailing matches
        if run > 0:
            spans.append((n, run + n))
    return spans


def tail_loop(token_ids: Sequence[int] | np.ndarray, *, max_period: int = 64) -> tuple[int, float]:
    """``(period, repeats)`` of the loop covering the most tokens at the end of ``token_ids`` (no prompt, no EOS),
    the shortest such period with ``max_period`` at most; ``(0, 0.0)`` when the end is not a loop."""
    spans = _tail_spans(np.asarray(token_ids, dtype=np.int64).ravel(), max_period)
    if not spans:
        return 0, 0.0
    period, span = max(spans, key=lambda ps: (ps[1], -ps[0]))
    return period, span / period


def collapse_flags(
    text: str,
    token_ids: Sequence[int] | np.ndarray,
    *,
    max_new_tokens: int,
    eos_hit: bool,
    kind: str = "math",
    max_period: int = 64,
    min_repeats: float = 4.0,
    min_span: int = 64,
) -> dict[str, bool]:
    """Flag a degenerate generation of ``text`` / ``token_ids`` (no prompt); ``kind`` is the answer kind.

    ``empty``: no non-whitespace text. ``no_answer``: no boxed answer or "answer is/:" phrase (no last-number
    fallback). ``repetition``: a tail loop (see the module docstring). ``max_tokens``: stopped at
    ``max_new_tokens`` without EOS. ``collapsed``: ``empty`` or ``repetition`` or (``max_tokens`` and
    ``no_answer``). ``early_stop``: :func:`stopped_early`.
    """
    ids = np.asarray(token_ids, dtype=np.int64).ravel()
    flags = {
        "empty": not text.strip(),
        "no_answer": extract_answer(text, kind, last_number=False) is None,
        "repetition": any(span >= min_span and span / n >= min_repeats for n, span in _tail_spans(ids, max_period)),
        "max_tokens": not eos_hit and len(ids) >= max_new_tokens,
    }
    flags["collapsed"] = flags["empty"] or flags["repetition"] or (flags["max_tokens"] and flags["no_answer"])
    return {**flags, "early_stop": stopped_early(flags)}


def stopped_early(flags: Mapping[str, Any] | None) -> bool:
    """Whether collapse flags say the output ended by itself without an answer and did not collapse (flags
    written before ``early_stop`` existed are read from ``no_answer``, ``max_tokens`` and ``collapsed``)."""
    if not isinstance(flags, Mapping):
        return False
    if "early_stop" in flags:
        return flags["early_stop"] is True
    return flags.get("no_answer") is True and flags.get("max_tokens") is False and flags.get("collapsed") is False
