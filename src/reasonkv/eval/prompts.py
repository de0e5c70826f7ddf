"""Prompt construction for reasoning benchmarks, and removal of the thinking block."""

from __future__ import annotations

from typing import Any

from reasonkv.eval.datasets import Problem
from reasonkv.eval.extraction import CODE_KINDS

__all__ = [
    "CHOICE_INSTRUCTION",
    "CODE_INSTRUCTION",
    "MATH_INSTRUCTION",
    "build_prompt",
    "code_message",
    "strip_thinking",
    "user_message",
]

MATH_INSTRUCTION = "Please reason step by step, and put the final answer in \\boxed{}."
CHOICE_INSTRUCTION = (
    "Please reason step by step, and answer with the letter of the correct option (A, B, C or D) "
    "in \\boxed{}, e.g. \\boxed{B}."
)

CODE_INSTRUCTION = "Please reason step by step, then give your complete solution in one ```python code block."

THINK_CLOSE = "</think>"


def code_message(problem: Problem) -> str:
    """The user turn of a code problem: a function to complete, or a statement with its interface."""
    extra = problem.extra
    if problem.kind == "code-function" and extra.get("entry_point"):  # a prompt that is code (HumanEval)
        return (
            f"Complete the Python function `{extra['entry_point']}`:\n\n```python\n{problem.problem.rstrip()}\n```\n\n"
            f"{CODE_INSTRUCTION} Include the imports and the whole function."
        )
    if problem.kind == "code-function":
        starter = extra.get("starter_code") or ""
        interface = (
            f"Use this starter code:\n\n```python\n{starter.rstrip()}\n```"
            if starter.strip()
            else f"Write a function named `{extra.get('function')}`."
        )
        return f"{problem.problem.strip()}\n\n{interface}\n\n{CODE_INSTRUCTION}"
    return (
        f"{problem.problem.strip()}\n\nWrite a Python program that reads the input from standard input and "
        f"writes the answer to standard output.\n\n{CODE_INSTRUCTION}"
    )


def user_message(problem: Problem | str) -> str:
    """The user turn: the problem text followed by the answer-format instruction."""
    if isinstance(problem, str):
        problem = Problem("", problem, "", "")  # a math problem
    if problem.kind in CODE_KINDS:
        return code_message(problem)
    instruction = CHOICE_INSTRUCTION if problem.kind == "choice" else MATH_INSTRUCTION
    return f"{problem.problem.strip()}\n\n{instruction}"


def build_prompt(tokenizer: Any, problem: Problem | str, *, thinking: bool | None = None) -> str:
    """The prompt text of one problem (a string is a math problem), to tokenize as it is: the tokenizer's chat
    template with the generation prompt, else ``"Problem: ...\\nSolution:"``. ``thinking`` (None: the
    template's default) is passed as ``enable_thinking`` to templates that read it (Qwen3 style; R1-distill
    templates open ``<think>`` themselves)."""
    message = user_message(problem)
    template = _template_source(tokenizer)
    if template is None and isinstance(problem, Problem) and problem.extra.get("entry_point"):
        return problem.problem  # a base model continues the function it is given (HumanEval's own format)
    if template is None:
        return f"Problem: {message}\nSolution:"
    kwargs: dict[str, Any] = {}
    if thinking is not None and "enable_thinking" in template:
        kwargs["enable_thinking"] = thinking
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    return text if isinstance(text, str) else text[0]  # some tokenizers return a one-element batch


def strip_thinking(text: str) -> str:
    """The text after the last ``</think>`` (all of it without one): a ``\\boxed{}`` tried out while thinking
    does not count once the model states a final answer."""
    _, sep, tail = text.rpartition(THINK_CLOSE)
    return tail if sep else text


def _template_source(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    if isinstance(template, dict):
        # Named templates: any of them mentioning enable_thinking counts as support.
        return "\n".join(str(v) for v in template.values())
    return str(template)
