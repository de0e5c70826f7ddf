"""Evaluation on reasoning benchmarks: datasets, prompts, answer grading, collapse detection, the
evaluation grid (:func:`run_grid`), fidelity to the full cache (:mod:`reasonkv.eval.fidelity`) and
reports (:func:`write_report`).

Importing this package does not import torch or transformers (the grid imports them when it runs).
"""

from reasonkv.eval.collapse import collapse_flags, tail_loop
from reasonkv.eval.datasets import DATASETS, Problem, load_dataset
from reasonkv.eval.extraction import extract_answer, find_answer
from reasonkv.eval.grading import Grade, grade, is_equivalent, normalize_answer
from reasonkv.eval.prompts import build_prompt, strip_thinking
from reasonkv.eval.report import write_report
from reasonkv.eval.runner import run_grid, sample_seed

__all__ = [
    "DATASETS",
    "Grade",
    "Problem",
    "build_prompt",
    "collapse_flags",
    "extract_answer",
    "find_answer",
    "grade",
    "is_equivalent",
    "load_dataset",
    "normalize_answer",
    "run_grid",
    "sample_seed",
    "strip_thinking",
    "tail_loop",
    "write_report",
]
