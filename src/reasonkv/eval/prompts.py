"""Prompt construction for reasoning benchmarks, and removal of the thinking block."""

from __future__ import annotations

from typing import Any

from reasonkv.eval.datasets import Problem

__all__ = ["CHOICE_INSTRUCTION", "MATH_INSTRUCTION", "build_prompt", "strip_thinking", "user_message"]

MATH_INSTRUCTION = "Please reason step by step, and put the final answer in \\boxed{}."
CHOICE_INSTRUCTION = (
    "Please reason step by step, and answer with the letter of the correct option (A, B, C or D) "
    "in \\boxed{}, e.g. \\boxed{B}."
)

THINK_CLOSE = "</think>"


def user_message(problem: Problem | str) -> str:
    """The user turn: the problem text followed by the answer-format instruction."""
    if isinstance(problem, str):
        text, kind = problem, "math"
    else:
        text, kind = problem.problem, problem.kind
    instruction = CHOICE_INSTRUCTION if kind == "choice" else MATH_INSTRUCTION
    return f"{text.strip()}\n\n{instruction}"


def build_prompt(tokenizer: Any, problem: Problem | str, *, thinking: bool | None = None) -> str:
    """Render the prompt text for one problem.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Its chat template is applied with ``add_generation_prompt=True``. Without a template the
        plain ``"Problem: ...\\nSolution:"`` format is used.
    problem : Problem or str
        A string is treated as a math problem.
    thinking : bool, optional
        ``None`` keeps the template's default. ``True``/``False`` is passed as ``enable_thinking``
        when the template reads that variable (Qwen3 style); other templates are unaffected.
        R1-distill style templates need nothing: the model opens (or the template pre-fills)
        ``<think>`` on its own.

    Returns
    -------
    str
        Text to tokenize; the chat template's special tokens are already in it.
    """
    message = user_message(problem)
    template = _template_source(tokenizer)
    if template is None:
        return f"Problem: {message}\nSolution:"
    kwargs: dict[str, Any] = {}
    if thinking is not None and "enable_thinking" in template:
        kwargs["enable_thinking"] = thinking
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    if not isinstance(text, str):  # some tokenizers return a one-element batch
        text = text[0]
    return text


def strip_thinking(text: str) -> str:
    """Return the text after the last ``</think>``, or ``text`` unchanged when there is none.

    Graders apply this first so that a ``\\boxed{}`` tried out while thinking does not count
    when the model states a final answer afterwards.
    """
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
