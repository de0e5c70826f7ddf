"""What reasonkv's local lm-eval tasks (``integrations/tasks/*.yaml``) call: their documents and their grading.

The documents are the bundled test sets (``reasonkv/data``), read by :func:`reasonkv.eval.datasets.load_dataset`,
so the tasks need no network. Every document carries ``prompt``, the user turn ``reasonkv eval`` asks (the
problem and the instruction to put the final answer in ``\\boxed{}``; lm-eval's ``--apply_chat_template`` wraps
it in the model's chat template as ``reasonkv eval`` does), and ``reference``, the reference solution as a
model would write it (GSM8K's calculator notes removed, its ``#### N`` line boxed). Generations are graded
by ``reasonkv eval``'s own grader, so ``exact_match`` here means what ``accuracy`` means there.
"""

from __future__ import annotations

from typing import Any

import datasets

from reasonkv.eval.datasets import Problem, load_dataset
from reasonkv.eval.grading import grade
from reasonkv.eval.prompts import user_message
from reasonkv.eval.references import box_final_answer, clean_solution

__all__ = ["gsm8k", "math500", "process_generation", "process_reference"]


def gsm8k(**_: Any) -> dict[str, datasets.Dataset]:
    """The bundled GSM8K test set (lm-eval passes the run's metadata as keywords; none is needed)."""
    return {"test": _documents("gsm8k")}


def math500(**_: Any) -> dict[str, datasets.Dataset]:
    """The bundled MATH-500."""
    return {"test": _documents("math500")}


def process_generation(doc: dict, results: list[str]) -> dict[str, float]:
    """``exact_match``: the generation's final answer is the reference answer (``reasonkv eval``'s grader)."""
    return {"exact_match": float(grade(results[0], _problem(doc)).correct)}


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
