r"""Pull the final answer out of a model's output text.

The first path that finds something wins, and within a path the *last* match in the text is used (models
restate and correct themselves); the path is reported as the method name, ``"none"`` if none found anything.

- ``kind="math"``: ``boxed`` (the last non-empty ``\boxed{...}`` / ``\fbox{...}`` / ``\framebox{...}`` with
  balanced braces, or ``\boxed X`` without braces), ``answer_is`` ("final answer is X", "final answer: X", "the
  answer is X"), ``answer_colon`` ("Answer: X"), ``last_number`` (the last number in the text, ``1,450,000`` ->
  ``1450000``; meant for integer-answer benchmarks such as GSM8K, skipped with ``last_number=False``).
- ``kind="choice"`` (a letter A-D): ``boxed`` (the last boxed content that reads as a letter: ``B``, ``(B)``,
  ``\text{B}``), ``answer_is`` ("the answer is (C)"), ``answer_colon`` ("Answer: C").
- ``kind="code-function"`` / ``"code-stdio"``: ``code_block``, the last complete fenced code block (```` ``` ````
  or ```` ```python ````; one in another language, or cut off before its closing fence, does not count).
"""

from __future__ import annotations

import re

__all__ = ["CODE_KINDS", "METHODS", "choice_letter", "extract_answer", "find_answer", "find_boxed", "find_code"]

METHODS = ("boxed", "answer_is", "answer_colon", "last_number", "code_block", "none")
#: Problem kinds whose answer is a program (graded by running it, see :mod:`reasonkv.eval.code`).
CODE_KINDS = ("code-function", "code-stdio")

_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)(?![A-Za-z])")
_BRACE_RE = re.compile(r"\\.|[{}]", re.S)
_ANSWER_IS_RE = re.compile(r"(?:final\s+answer\s*(?:is|[:=])|\banswer\s+is)\s*:?", re.IGNORECASE)
_ANSWER_COLON_RE = re.compile(r"\banswer\s*[:：]", re.IGNORECASE)
# A minus sign counts only when it is not a binary minus ("10-5" ends in 5, not -5).
_SIGN = r"(?:(?<![\w)\]}])-)?"
_NUMBER_RE = re.compile(_SIGN + r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
_LETTER_RE = re.compile(r"^(?:option|choice)?\s*\(?([A-D])(?:[).:,\s]|$)", re.IGNORECASE)
_LATEX_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mathit|bf)\s*")
_MATH_DELIMS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
_FENCE_RE = re.compile(r"^[ \t]{0,3}```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^[ \t]{0,3}```", re.M | re.S)
_PYTHON_TAGS = ("", "python", "python3", "py", "py3")


def find_boxed(text: str) -> list[str]:
    r"""All non-empty boxed contents in order of appearance (``\boxed``, ``\fbox``, ``\framebox``)."""
    contents = (_box_content(text, match.end()) for match in _BOX_RE.finditer(text))
    return [content for content in contents if content]


def _box_content(text: str, pos: int) -> str | None:
    start, pos = pos, len(text) - len(text[pos:].lstrip())
    if pos < len(text) and text[pos] == "[":  # \framebox[width]{...}
        close = text.find("]", pos)
        pos = close + 1 if close >= 0 else pos
    if pos >= len(text):
        return None
    if text[pos] != "{":
        if pos == start:  # "\boxed5" is not the command followed by an argument
            return None
        bare = re.match(r"[^\s$]+", text[pos:])
        return bare.group(0).rstrip(".,;") if bare else None
    span = brace_span(text, pos)
    return None if span is None else text[span[0] : span[1]]  # None: the output was cut off inside the box


def brace_span(text: str, pos: int) -> tuple[int, int] | None:
    """``[start, end)`` of the content, stripped, of the braces that open at ``text[pos]``; None if they never close."""
    depth = 0
    for match in _BRACE_RE.finditer(text, pos):
        depth += {"{": 1, "}": -1}.get(match.group(), 0)  # an escaped brace (\{ or \}) does not count
        if depth == 0:
            inner = text[pos + 1 : match.start()]
            return pos + 1 + len(inner) - len(inner.lstrip()), pos + 1 + len(inner.rstrip())
    return None


def find_answer(text: str, kind: str = "math", *, last_number: bool = True) -> tuple[str | None, str]:
    """``(answer, method)``: the final answer of ``text`` (strip the thinking first if the answer must follow it)
    and the extraction path (module docstring), or ``(None, "none")``. ``last_number``: allow the last-number
    fallback (``kind="math"`` only)."""
    if kind in CODE_KINDS:
        code = find_code(text)
        return (code, "code_block") if code is not None else (None, "none")
    if kind == "choice":
        boxed, stated = choice_letter, lambda rest: choice_letter(rest[:40].lstrip(" *_:"))
    elif kind == "math":
        boxed, stated = str, _clean_span
    else:
        raise ValueError(f"kind must be 'math' or 'choice', got {kind!r}")
    for content in reversed(find_boxed(text)):
        if answer := boxed(content):
            return answer, "boxed"
    for method, pattern in (("answer_is", _ANSWER_IS_RE), ("answer_colon", _ANSWER_COLON_RE)):
        for match in reversed(list(pattern.finditer(text))):
            if answer := stated(text[match.end() :]):
                return answer, method
    if last_number and kind == "math":
        numbers = _NUMBER_RE.findall(text)
        if numbers:
            return numbers[-1].replace(",", ""), "last_number"
    return None, "none"


def find_code(text: str) -> str | None:
    """The last complete fenced Python code block of ``text`` (its content), or ``None``."""
    blocks = [m.group(2) for m in _FENCE_RE.finditer(text) if m.group(1).lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def extract_answer(text: str, kind: str = "math", *, last_number: bool = True) -> str | None:
    """Extract the final answer (see the module docstring for the order); ``None`` if absent."""
    return find_answer(text, kind, last_number=last_number)[0]


def choice_letter(text: str) -> str | None:
    r"""Read a multiple-choice letter from a short answer: ``B``, ``(B)``, ``\text{B}``, ``B) 42``."""
    cleaned = re.sub(r"[$*{}]", "", _LATEX_WRAP_RE.sub("", text)).strip()
    match = _LETTER_RE.match(cleaned)
    if not match:
        return None
    letter = match.group(1)
    # A lone lower-case letter is more likely a variable than an option.
    return letter if letter.isupper() or cleaned.lower().startswith(("option", "choice")) else None


def _clean_span(rest: str) -> str | None:
    """The answer phrase that starts ``rest``: one math span, else the rest of the sentence."""
    rest = rest.lstrip(" \t*_:")
    for open_, close in _MATH_DELIMS:
        if rest.startswith(open_):
            end = rest.find(close, len(open_))
            rest = rest[len(open_) : end if end >= 0 else None]
            break
    else:
        rest = rest.split("\n", 1)[0]
        rest = re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0]  # a sentence end, not a decimal point
    rest = rest.strip().strip("*_").strip().rstrip(".,;:").strip()
    return rest or None
