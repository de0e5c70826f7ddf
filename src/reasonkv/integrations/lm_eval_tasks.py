"""What reasonkv's local lm-eval tasks (``integrations/tasks/*.yaml``) call: their documents and their grading.

The documents are the bundled test sets, each with ``prompt`` (the user turn ``reasonkv eval`` asks) and
``reference`` (the reference solution as a model would write it). Generations are graded by ``reasonkv eval``'s
own grader: the last-number fallback only for an output known to have ended by itself (a :class:`Generation`
says how it ended; a plain text does not), so ``exact_match`` means what ``accuracy`` means there.
"""

from __future__ import annotations

from typing import Any

import datasets

from reasonkv.eval.datasets import Problem, load_dataset
from reasonkv.eval.grading import grade
from reasonkv.eval.prompts import user_message
from reasonkv.eval.references import box_final_answer, clean_solution

__all__ = ["Generation", "gsm8k", "math500", "process_generation", "process_reference"]


class Generation(str):
    """A generated text that says how decoding ended (``finish_reason``: ``eos``, ``stop`` or ``length``): a
    ``str``, so lm-eval handles it as any response, that :func:`process_generation` grades as ``reasonkv eval``."""

    finish_reason: str | None

    def __new__(cls, text: str, finish_reason: str | None = None) -> Generation:  # None: copy/pickle sets it after
        made = super().__new__(cls, text)
        made.finish_reason = finish_reason
        return made


def ended_by_itself(text: str) -> bool:
    """Whether a response is known to have ended by itself (an end of sequence or a stop string)."""
    return getattr(text, "finish_reason", None) in ("eos", "stop")


def gsm8k(**_: Any) -> dict[str, datasets.Dataset]:
    """The bundled GSM8K test set (lm-eval passes the run's metadata as keywords; none is needed)."""
    return {"test": _documents("gsm8k")}


def math500(**_: Any) -> dict[str, datasets.Dataset]:
    """The bundled MATH-500."""
    return {"test": _documents("math500")}


def process_generation(doc: dict, results: list[str]) -> dict[str, float]:
    """``exact_match``: the generation's final answer is the reference answer (``reasonkv eval``'s grader; the
    last-number fallback only for an output that ended by itself, see :func:`ended_by_itself`)."""
    text = results[0]
    return {"exact_match": float(grade(text, _problem(doc), complete=ended_by_itself(text)).correct)}


def process_reference(doc: dict, results: list[tuple[float, bool]]) -> dict[str, float]:
    """``logprob``: the reference solution's log-likelihood; ``greedy``: whether greedy decoding would write it."""
    logprob, greedy = results[0]
    return {"logprob": float(logprob), "greedy": float(greedy)}


def _documents(name: str) -> datasets.Dataset:
    rows = [
        {
            "id": problem.id,
            "problem": problem.problem,
            "answer": problem.answer,
            "kind": problem.kind,
            "prompt": user_message(problem),
            "reference": box_final_answer(clean_solution(problem.solution or "")),
        }
        for problem in load_dataset(name)
    ]
    return datasets.Dataset.from_list(rows)


def _problem(doc: dict) -> Problem:
    return Problem(id=doc["id"], problem=doc["problem"], answer=doc["answer"], source="", kind=doc["kind"])
