"""Evaluation on reasoning benchmarks: datasets, prompts, answer grading, collapse detection, the grid
(:class:`GridSpec`, :func:`run_grid`), fidelity to the full cache and reports (:func:`write_report`).
The grid and the runner, which need torch, load on first use.
"""

from __future__ import annotations

import importlib

from reasonkv.eval.collapse import collapse_flags, tail_loop
from reasonkv.eval.datasets import DATASETS, Problem, load_dataset
from reasonkv.eval.extraction import extract_answer, find_answer
from reasonkv.eval.grading import Grade, grade, is_equivalent, normalize_answer
from reasonkv.eval.prompts import build_prompt, strip_thinking
from reasonkv.eval.report import write_report
from reasonkv.eval.units import sample_seed

_HEAVY = {"GridSpec": "reasonkv.eval.grid", "run_grid": "reasonkv.eval.runner", "plan_grid": "reasonkv.eval.plan"}

__all__ = [
    "DATASETS",
    "Grade",
    "GridSpec",
    "Problem",
    "build_prompt",
    "collapse_flags",
    "extract_answer",
    "find_answer",
    "grade",
    "is_equivalent",
    "load_dataset",
    "normalize_answer",
    "plan_grid",
    "run_grid",
    "sample_seed",
    "strip_thinking",
    "tail_loop",
    "write_report",
]


# Not reasonkv.lazy_exports: the light imports (grading without torch) load this package without reasonkv's.
def __getattr__(name: str):
    module = _HEAVY.get(name)
    if module is None:
        raise AttributeError(f"module 'reasonkv.eval' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
