"""What reasonkv's local lm-eval tasks (``integrations/tasks/*.yaml``) call: their documents and their grading.

The documents are the bundled test sets (``reasonkv/data``), read by :func:`reasonkv.eval.datasets.load_dataset`,
so the tasks need no network. Every document carries ``prompt``, the user turn ``reasonkv eval`` asks (the
problem and the instruction to put the final answer in ``\\boxed{}``; lm-eval's ``--apply_chat_template`` wraps
it in the model's chat template as ``reasonkv eval`` does), and ``reference``, the reference solution as a
model would write it (GSM8K's calculator notes removed, its ``#### N`` line boxed). Generations are graded
by ``reasonkv eval``'s own grader, so ``exact_match`` here means what ``accuracy`` means there: the
last-number fallback is taken only from an output that ended by itself, never from one cut off at the token
limit. reasonkv's lm-eval model returns each text as a :class:`Generation`, which says how it ended; a plain
text (another lm-eval model, or lm-eval's ``--use_cache``) does not, so its last number is never taken.
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
    """A generated text that says how decoding ended (``finish_reason``: ``eos``, ``stop`` or ``length``).

    A ``str`` so lm-eval handles it as any response (filters, logged samples); :func:`process_generation`
    reads ``finish_reason`` to grade as ``reasonkv eval`` does.
    """

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
    rows = []
    for problem in load_dataset(name):
        solution = problem.solution or ""
        rows.append(
            {
                "id": problem.id,
                "problem": problem.problem,
                "answer": problem.answer,
                "kind": problem.kind,
                "prompt": user_message(problem),
                "reference": box_final_answer(clean_solution(solution)),
            }
        )
    return datasets.Dataset.from_list(rows)


def _problem(doc: dict) -> Problem:
    return Problem(id=doc["id"], problem=doc["problem"], answer=doc["answer"], source="", kind=doc["kind"])
