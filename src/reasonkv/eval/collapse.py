"""Detect degenerate generations: empty output, a token loop at the end, or running out of tokens; and an
output that stopped by itself without an answer.

A *tail loop* has period ``n`` when every one of the last ``L + n`` tokens equals the token ``n``
positions before it for the last ``L`` of them, i.e. the final ``n``-token block repeats
``(L + n) / n`` times (a cut-off partial block counts fractionally). The generation is flagged
as repeating when, for some ``n <= max_period``, the loop repeats at least ``min_repeats`` times
and spans at least ``min_span`` tokens. The span floor keeps short legitimate runs (``0 & 0 & 0``,
a row of ``=``) from counting; the repeat floor keeps a long phrase said twice from counting.
With the defaults (64, 4) a 7-token phrase must occur about 10 times, a single token 64 times,
and a 64-token paragraph 4 times.

An output that ends by itself (an end of sequence, not the token limit) before giving an answer is not a
collapse, but it is no success either: a policy that makes the model stop early would otherwise look
better on the collapse rate than the full cache whose long outputs run out of tokens. It is flagged
``early_stop`` and counted apart (the report's early-stop rate).
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
    """Find the loop that covers the most tokens at the end of a sequence.

    Parameters
    ----------
    token_ids : sequence of int
        Generated token ids (without the prompt or a trailing EOS).
    max_period : int
        Longest loop period considered.

    Returns
    -------
    (period, repeats)
        The shortest period among those covering the longest tail, and how many times its block
        repeats (fractional for a cut-off block); ``(0, 0.0)`` when the end is not a loop.
    """
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
    """Flag a degenerate generation.

    Parameters
    ----------
    text : str
        Decoded generated text.
    token_ids : sequence of int
        Generated token ids (without the prompt).
    max_new_tokens : int
        The generation budget.
    eos_hit : bool
        Whether generation ended on an end-of-sequence token.
    kind : {"math", "choice"}
        Answer kind, for ``no_answer``.
    max_period, min_repeats, min_span
        Loop thresholds (see the module docstring).

    Returns
    -------
    dict of str to bool
        ``empty``: no non-whitespace text. ``no_answer``: no boxed answer or "answer is/:" phrase
        (the last-number fallback is not used here). ``repetition``: a tail loop as defined above.
        ``max_tokens``: stopped at ``max_new_tokens`` without EOS. ``collapsed``: ``empty`` or
        ``repetition`` or (``max_tokens`` and ``no_answer``). ``early_stop``: ended before the limit with
        ``no_answer`` and not ``collapsed`` (see :func:`stopped_early`).
    """
    ids = np.asarray(token_ids, dtype=np.int64).ravel()
    empty = not text.strip()
    no_answer = extract_answer(text, kind, last_number=False) is None
    repetition = any(span >= min_span and span / n >= min_repeats for n, span in _tail_spans(ids, max_period))
    max_tokens = not eos_hit and len(ids) >= max_new_tokens
    flags = {
        "empty": empty,
        "no_answer": no_answer,
        "repetition": repetition,
        "max_tokens": max_tokens,
        "collapsed": empty or repetition or (max_tokens and no_answer),
    }
    return {**flags, "early_stop": stopped_early(flags)}


def stopped_early(flags: Mapping[str, Any] | None) -> bool:
    """Whether collapse flags say the output ended by itself without an answer and did not collapse.

    Reads the flags of records written before ``early_stop`` existed too (from ``no_answer``,
    ``max_tokens`` and ``collapsed``); ``False`` when there are none.
    """
    if not isinstance(flags, Mapping):
        return False
    if "early_stop" in flags:
        return flags["early_stop"] is True
    return flags.get("no_answer") is True and flags.get("max_tokens") is False and flags.get("collapsed") is False
