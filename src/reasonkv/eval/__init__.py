"""Evaluation on reasoning benchmarks: datasets, prompts, answer grading and collapse detection.

Importing this package does not import torch or transformers.
"""

from reasonkv.eval.collapse import collapse_flags, tail_loop
from reasonkv.eval.datasets import DATASETS, Problem, load_dataset
from reasonkv.eval.extraction import extract_answer, find_answer
from reasonkv.eval.grading import Grade, grade, is_equivalent, normalize_answer
from reasonkv.eval.prompts import build_prompt, strip_thinking

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
    "strip_thinking",
    "tail_loop",
]
