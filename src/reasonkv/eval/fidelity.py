r"""Fidelity to the full cache: how far an evicting cache moves the model's next-token distributions.

Both measurements are teacher-forced (known tokens are fed, nothing is sampled), so they work even for a model
too small to solve the problems:

1. **Trace fidelity** (:func:`trace_fidelity`): the full cache's greedy trace, fed after the prompt through the
   full and the evicting cache. *Top-1 agreement* is the fraction of steps where the evicting cache's argmax is
   the trace's next token, with the mean *KL(full || evicting)*; ``top1_full_replay`` is the same agreement for
   the replayed full cache itself, the numerical floor (1.0 in fp32; slightly less in bf16).
2. **Reference-answer log-probability** (:func:`answer_logprob`): a reference solution fed after the prompt,
   the log-probabilities of its final-answer tokens summed with each cache; the deltas (evicting minus full)
   say how much eviction made the right answer less likely.

The evicting cache evicts after the forward pass in which a row reaches ``budget + buffer`` tokens, and between
two evictions only grows. For a policy whose ``observe`` is invariant to chunking (``chunk_exact``), feeding the
tokens up to the next due eviction in one forward pass is therefore exactly that many decode steps; other
policies are stepped one token at a time (their per-step signals depend on it). The prompt is one forward pass,
the full cache side is always chunked, and a chunk stops at the earliest due row of the batch, so every row
evicts where it would alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from reasonkv.cache.evicting import EvictingCache
from reasonkv.cache.spec import CacheSpec, resolve_spec
from reasonkv.eval.datasets import Problem
from reasonkv.eval.references import answer_span, clean_solution, token_span
from reasonkv.eval.step_bytes import StepBytes
from reasonkv.generation.step import EagerStep, decode
from reasonkv.hf import left_pad

__all__ = [
    "AnswerFidelity",
    "Replay",
    "TeacherForced",
    "TraceFidelity",
    "answer_logprob",
    "answer_span",
    "reference_continuation",
    "replay_logits",
    "teacher_force",
    "trace_fidelity",
]

DEFAULT_MAX_CHUNK = 64  # tokens per forward pass: bounds the [batch, chunk, vocab] logits held


@dataclass
class Replay:
    """Teacher-forced logits of one row: ``evicting[i]`` and ``full[i]`` predict ``continuation[i]``."""

    evicting: torch.Tensor  # [n, vocab], float32
    full: torch.Tensor  # [n, vocab], float32
    evictions: int


@dataclass
class TraceFidelity:
    """Trace fidelity of one row (see the module docstring)."""

    steps: int
    top1_agreement: float
    top1_full_replay: float
    kl_mean: float
    kl_max: float
    evictions: int
    chunked: bool
    steady_kv_bytes: dict | None = None  # as TeacherForced's; None if the row was never evicted
    step_bytes: dict | None = None  # as TeacherForced's (equal held and read for an eviction cache); None: 1 token


@dataclass
class AnswerFidelity:
    """Log-probability of the reference answer tokens with each cache, and their differences."""

    reference_tokens: int  # tokens of the solution fed up to the end of the answer
    answer_tokens: int
    logprob_full: float
    logprob_evicting: float
    delta_sum: float  # logprob_evicting - logprob_full
    delta_mean: float  # the same, per answer token
    evictions: int


# consume(start, evicting_logits [B, s, V], full_logits [B, s, V] or None, active rows): column t of
# row r predicts continuation[r][start + t].
Consumer = Callable[[int, torch.Tensor, torch.Tensor | None, list[int]], None]


@dataclass
class TeacherForced:
    """What the evicting cache did in :func:`teacher_force`."""

    evictions: list[int]  # per row, when its last token was fed
    peak_slots: int  # the most slots the batch's cache held (padding included; a long prompt before its eviction)
    kv_bytes: int  # K/V storage the cache held after the last forward (allocated capacity, all tiers)
    steady_kv_bytes: list[dict | None]  # per row: held right after its evictions, averaged (KVStorage.steady_kv_bytes)
    step_bytes: list[dict | None]  # per row: K/V bytes held and read per decode step, mean (StepBytes.per_row)


@torch.inference_mode()
def teacher_force(
    model,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    spec: CacheSpec,
    *,
    consume: Consumer,
    chunked: bool | None = None,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    pad_id: int = 0,
    reference: bool = True,
) -> TeacherForced:
    """Feed ``prompt + continuation`` rows through an evicting cache, and with ``reference`` through a full
    cache in lockstep (see the module docstring: one prefill, then chunks that end where an eviction is due,
    or one token at a time). ``consume`` receives the logits as they come (``None`` for the full cache's
    without ``reference``).
    """
    if len(prompts) != len(continuations) or not prompts:
        raise ValueError("need one continuation per prompt, and at least one row")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    if max_chunk < 1:
        raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
    if chunked is None:
        chunked = bool(getattr(type(spec.policy), "chunk_exact", False))
    device = next(model.parameters()).device
    evicting = EvictingCache(model=model, spec=spec)
    full = EvictingCache(model=model, spec=CacheSpec("full")) if reference else None
    replay = _Replay(model, evicting, full, continuations, chunked, max_chunk, pad_id, consume)
    try:
        ids, mask = left_pad(prompts, pad_id, device)
        replay.prefill(ids, mask)
        decode(replay, None, replay.next_input)
        return TeacherForced(
            replay.evictions,
            evicting.peak_slots,
            evicting.kv_bytes(),
            evicting.steady_kv_bytes(),
            replay.step_bytes.per_row(),
        )
    finally:
        evicting.detach()
        if full is not None:
            full.detach()


class _Replay:
    """:func:`teacher_force`'s decode step: each step feeds the next span of every unfinished row's known tokens
    (one chunk up to the next due eviction, or token by token) to the evicting cache and the full one, and hands
    their logits to ``consume``."""

    def __init__(self, model, evicting, full, continuations, chunked, max_chunk, pad_id, consume):
        self.evicting, self.chunked, self.max_chunk, self.pad_id = evicting, chunked, max_chunk, pad_id
        self.continuations, self.consume = continuations, consume
        self.lengths = [len(c) for c in continuations]
        self.steps = EagerStep(model, evicting, every_position=True)
        self.reference = None if full is None else EagerStep(model, full, every_position=True)
        self.evictions = [0] * len(continuations)
        self.step_bytes = StepBytes(evicting, len(continuations))
        self.fed, self.active = 0, []

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The prompts, one forward each cache; their last logits predict every continuation's first token."""
        logits_e = self.steps.prefill(ids, mask).unsqueeze(1)
        logits_f = None if self.reference is None else self.reference.prefill(ids, mask).unsqueeze(1)
        started = [r for r, n in enumerate(self.lengths) if n > 0]
        if started:
            self.consume(0, logits_e, logits_f, started)
        self._note_finished(range(len(self.lengths)))

    def next_input(self, _index: int, _logits) -> tuple[torch.Tensor, None] | None:
        """The next span of known tokens (pad for the rows done), or None once every row was fed."""
        fed = self.fed
        self.active = [r for r, n in enumerate(self.lengths) if fed < n - 1]
        if not self.active:
            return None
        span = min(min(self.lengths[r] - 1 - fed for r in self.active), self.max_chunk)
        if self.chunked and self.evicting.spec.stored_budget is not None:
            span = min(span, max(1, int(self.evicting.rows.until_due()[self.active].min())))
        tokens = torch.full((len(self.lengths), span), self.pad_id, dtype=torch.long)
        for r in self.active:
            tokens[r] = torch.tensor(list(self.continuations[r][fed : fed + span]), dtype=torch.long)
        return tokens.to(self.steps.device), None

    def __call__(self, tokens: torch.Tensor, _mask: None) -> torch.Tensor:
        spans = [tokens] if self.chunked else tokens.split(1, dim=1)
        logits = []
        for piece in spans:
            self.step_bytes.before()
            logits.append(self.steps(piece))
            self.step_bytes.after(piece.shape[1], self.active)
        logits_e = torch.cat(logits, dim=1)
        logits_f = None if self.reference is None else self.reference(tokens)
        self.consume(self.fed + 1, logits_e, logits_f, self.active)
        self.fed += tokens.shape[1]
        self._note_finished(self.active)
        return logits_e

    def _note_finished(self, rows) -> None:
        """A row's eviction count, as its last token was fed."""
        for r in rows:
            if self.fed >= self.lengths[r] - 1:
                self.evictions[r] = int(self.evicting.row_evictions[r])


def _replay(model, prompts, continuations, spec, cache_keywords: dict, consume: Consumer, **replay):
    """:func:`teacher_force` under ``spec`` or the cache's keywords (``seeds=``, the old name of ``seed=``, warned
    about); returns what it did and the spec."""
    if "seeds" in cache_keywords:
        warnings.warn(
            "seeds= is deprecated: pass seed= (one per row, or one for all)", DeprecationWarning, stacklevel=3
        )
        cache_keywords["seed"] = cache_keywords.pop("seeds")
    spec = resolve_spec(spec, **cache_keywords)
    return teacher_force(model, prompts, continuations, spec, consume=consume, **replay), spec


def replay_logits(
    model,
    prompt_ids: Sequence[int],
    continuation_ids: Sequence[int],
    spec: CacheSpec | None = None,
    *,
    chunked: bool | None = None,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    pad_id: int = 0,
    **cache_keywords,
) -> Replay:
    """Teacher-force one ``prompt + continuation`` through the evicting and the full cache.

    The evicting cache is a :class:`~reasonkv.cache.CacheSpec` or its keywords (``policy``, ``budget``, ``seed``,
    ...). ``chunked``: ``None`` chunks between evictions when the policy class has ``chunk_exact``, else steps
    token by token; ``True``/``False`` force one or the other (chunks on a policy that is not chunk-exact give a
    cheaper approximation). ``max_chunk``: the most tokens per forward pass.
    """
    pieces: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # the evicting cache's, the full one's

    def consume(start, logits_e, logits_f, active):
        for kept, logits in zip(pieces, (logits_e, logits_f), strict=True):
            kept.append(logits[0].float().cpu())

    replay = dict(chunked=chunked, max_chunk=max_chunk, pad_id=pad_id)
    forced, _ = _replay(model, [list(prompt_ids)], [list(continuation_ids)], spec, cache_keywords, consume, **replay)
    n = len(continuation_ids)
    evicting, full = (torch.cat(kept)[:n] if kept else torch.empty(0) for kept in pieces)
    return Replay(evicting=evicting, full=full, evictions=forced.evictions[0])


def _kl(logp_full: torch.Tensor, logp_evicting: torch.Tensor) -> torch.Tensor:
    """``KL(full || evicting)`` over the last dimension (0 where the full probability is 0)."""
    p = logp_full.exp()
    terms = torch.where(p > 0, p * (logp_full - logp_evicting), torch.zeros_like(p))
    return terms.sum(-1)


def trace_fidelity(
    model,
    prompts: Sequence[Sequence[int]],
    traces: Sequence[Sequence[int]],
    spec: CacheSpec | None = None,
    *,
    chunked: bool | None = None,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    pad_id: int = 0,
    **cache_keywords,
) -> list[TraceFidelity]:
    """Top-1 agreement and KL of the evicting cache (see :func:`replay_logits`; its ``seed`` one per row or one for
    all) against the full cache along greedy ``traces`` (the full cache's output for each prompt, EOS included),
    replayed as one batch: one :class:`TraceFidelity` per row (``nan`` metrics for an empty trace)."""
    batch = len(prompts)
    agree = [0] * batch
    agree_full = [0] * batch
    kl_sum = [0.0] * batch
    kl_max = [0.0] * batch

    def consume(start, logits_e, logits_f, active):
        span = logits_e.shape[1]
        for r in active:
            target = torch.tensor(list(traces[r][start : start + span]), device=logits_e.device)
            le, lf = logits_e[r].float(), logits_f[r].float()
            agree[r] += int((le.argmax(-1) == target).sum())
            agree_full[r] += int((lf.argmax(-1) == target).sum())
            kl = _kl(lf.log_softmax(-1), le.log_softmax(-1))
            kl_sum[r] += float(kl.sum())
            kl_max[r] = max(kl_max[r], float(kl.max()))

    replay = dict(chunked=chunked, max_chunk=max_chunk, pad_id=pad_id)
    forced, spec = _replay(model, prompts, traces, spec, cache_keywords, consume, **replay)
    chunk_flag = bool(getattr(type(spec.policy), "chunk_exact", False)) if chunked is None else chunked
    nan = float("nan")
    return [
        TraceFidelity(
            steps=(n := len(traces[r])),
            top1_agreement=agree[r] / n if n else nan,
            top1_full_replay=agree_full[r] / n if n else nan,
            kl_mean=kl_sum[r] / n if n else nan,
            kl_max=kl_max[r] if n else nan,
            evictions=forced.evictions[r],
            chunked=chunk_flag,
            steady_kv_bytes=forced.steady_kv_bytes[r],
            step_bytes=forced.step_bytes[r],
        )
        for r in range(batch)
    ]


def reference_continuation(tokenizer, problem: Problem) -> tuple[list[int], int, int] | None:
    """``(ids, a, b)``: the token ids of ``problem``'s reference solution cut after its answer, at ``ids[a:b]``;
    ``None`` when the problem has no solution or no answer can be located in it."""
    if not problem.solution or not problem.solution.strip():
        return None
    text = clean_solution(problem.solution)
    ids, span = token_span(tokenizer, text, answer_span(text, problem.answer))
    if span is None:
        return None
    a, b = span
    return ids[:b], a, b


def answer_logprob(
    model,
    prompts: Sequence[Sequence[int]],
    references: Sequence[tuple[Sequence[int], int, int]],
    spec: CacheSpec | None = None,
    *,
    chunked: bool | None = None,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    pad_id: int = 0,
    **cache_keywords,
) -> list[AnswerFidelity]:
    """Log-probability of each reference answer, teacher-forced after its prompt, with both caches (the evicting
    one as in :func:`trace_fidelity`). ``references``: ``(ids, a, b)`` per row from :func:`reference_continuation`,
    the solution tokens and the answer's token range ``[a, b)``."""
    batch = len(prompts)
    logp_e = [0.0] * batch
    logp_f = [0.0] * batch
    continuations = [list(ids)[:b] for ids, _, b in references]

    def consume(start, logits_e, logits_f, active):
        span = logits_e.shape[1]
        for r in active:
            _, a, b = references[r]
            lo, hi = max(a, start), min(b, start + span)
            if lo >= hi:
                continue
            target = torch.tensor(continuations[r][lo:hi], device=logits_e.device).unsqueeze(-1)
            cols = slice(lo - start, hi - start)
            logp_e[r] += float(logits_e[r, cols].float().log_softmax(-1).gather(-1, target).sum())
            logp_f[r] += float(logits_f[r, cols].float().log_softmax(-1).gather(-1, target).sum())

    replay = dict(chunked=chunked, max_chunk=max_chunk, pad_id=pad_id)
    forced, _ = _replay(model, prompts, continuations, spec, cache_keywords, consume, **replay)
    return [
        AnswerFidelity(
            reference_tokens=b,
            answer_tokens=b - a,
            logprob_full=logp_f[r],
            logprob_evicting=logp_e[r],
            delta_sum=logp_e[r] - logp_f[r],
            delta_mean=(logp_e[r] - logp_f[r]) / (b - a),
            evictions=forced.evictions[r],
        )
        for r, (_, a, b) in enumerate(references)
    ]
