r"""The token sequences the anatomy is measured on, with the span of their final answer (docs/calibrate.md).

A :class:`Trace` is a chat-formatted prompt followed by a reasoning trace, both as token ids: the dataset's
reference solution (:func:`reference_trace`, GSM8K's tidied by :func:`tidy_reference`) or the model's own greedy
answer (:func:`generated_trace`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from reasonkv.eval.prompts import build_prompt
from reasonkv.eval.references import answer_span, box_final_answer, clean_solution, token_span
from reasonkv.generation import generate
from reasonkv.generation.inputs import encode_prompt

__all__ = [
    "SOURCES",
    "Trace",
    "generated_trace",
    "prompt_ids",
    "reference_trace",
    "tidy_reference",
]

SOURCES = ("reference", "generated")


@dataclass(frozen=True)
class Trace:
    """One prompt (special tokens included) and the trace that follows it, as token ids."""

    id: str  # the problem's, unique within a run
    prompt_ids: list[int]
    trace_ids: list[int]
    answer_span: tuple[int, int] | None  # [start, end) of the final answer in trace_ids
    source: str  # one of SOURCES
    text: str = ""  # the trace text, for people reading the records

    @property
    def ids(self) -> list[int]:
        return [*self.prompt_ids, *self.trace_ids]

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)


def tidy_reference(solution: str) -> str:
    r"""GSM8K-style solution -> plain text: drop ``<<...>>``, turn ``#### X`` into ``\boxed{X}``."""
    return box_final_answer(clean_solution(solution))


def prompt_ids(tokenizer: Any, problem: Any) -> list[int]:
    """The chat-formatted prompt of a problem as token ids (the chat template's own BOS is not doubled)."""
    return encode_prompt(tokenizer, build_prompt(tokenizer, problem))


def reference_trace(tokenizer: Any, problem: Any, *, max_tokens: int | None = None) -> Trace:
    """The problem's reference solution (:func:`tidy_reference`'d) after its prompt, cut to ``max_tokens`` (the
    answer span dropped if it is cut); ``ValueError`` for a problem without a solution."""
    if not problem.solution:
        raise ValueError(f"problem {problem.id!r} has no reference solution; use source='generated'")
    text = tidy_reference(problem.solution)
    trace_ids, span = token_span(tokenizer, text, answer_span(text))
    if max_tokens is not None and len(trace_ids) > max_tokens:
        trace_ids, span = trace_ids[:max_tokens], span if span is not None and span[1] <= max_tokens else None
    if not trace_ids:
        raise ValueError(f"problem {problem.id!r}: the reference solution is empty")
    return Trace(problem.id, prompt_ids(tokenizer, problem), trace_ids, span, "reference", text)


def generated_trace(model: Any, tokenizer: Any, problem: Any, *, max_new_tokens: int = 512) -> Trace:
    """The model's greedy answer to the problem (full cache), its end-of-sequence token dropped."""
    prompt = prompt_ids(tokenizer, problem)
    [result] = generate(model, tokenizer, [prompt], policy="full", max_new_tokens=max_new_tokens)
    trace_ids = list(result.token_ids[:-1] if result.finish_reason == "eos" else result.token_ids)
    if not trace_ids:
        raise ValueError(f"problem {problem.id!r}: the model generated nothing")
    text, ends = _decoded_ends(tokenizer, trace_ids)
    char_span = answer_span(text)
    span = None
    if char_span is not None:
        starts = [0, *ends[:-1]]
        hits = [i for i, (a, b) in enumerate(zip(starts, ends, strict=True)) if a < char_span[1] and b > char_span[0]]
        span = (hits[0], hits[-1] + 1) if hits else None
    return Trace(problem.id, prompt, trace_ids, span, "generated", text)


def _decoded_ends(tokenizer: Any, ids: list[int]) -> tuple[str, list[int]]:
    """The decoded text and, per token, the text length once it is decoded (prefix decodes)."""
    ends = [len(tokenizer.decode(ids[: i + 1], skip_special_tokens=False)) for i in range(len(ids))]
    ends = list(accumulate(ends, max))  # an incomplete UTF-8 sequence can shorten a prefix
    return tokenizer.decode(ids, skip_special_tokens=False), ends
