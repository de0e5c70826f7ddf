"""Text prompts and the chat template: what ``generate`` does to a string before tokenizing it.

An instruct model given bare text often ends at once, so ``reasonkv.generate`` and the commands apply the
tokenizer's chat template to text prompts by default, here. Text that already holds the template is left as
it is: a template applied twice nests one turn in another.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chat_prompt", "has_template", "is_templated"]

_MARK = "\x00reasonkv-user-text\x00"  # stands in for the user's words, to find where the template puts them


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer: Any, text: str) -> str:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return rendered if isinstance(rendered, str) else rendered[0]  # some tokenizers return a batch of one


def _marks(tokenizer: Any) -> tuple[list[str], str]:
    """What a templated text starts with (the template's text before the user's words, and the special token
    that opens it: a conversation with its own system turn starts with that token, not with the default
    turn), and what it ends with (the opening of the assistant's turn)."""
    prefix, _, suffix = _render(tokenizer, _MARK).partition(_MARK)
    special = set(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "get_added_vocab", None)
    special.update(added() if callable(added) else ())
    opening = max((token for token in special if token and prefix.startswith(token)), key=len, default=None)
    starts = [start for start in (prefix, opening) if start]
    return starts, suffix.strip()


def is_templated(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` already reads as the tokenizer's chat template renders a conversation: it starts as
    the template starts, or ends with the opening of the assistant's turn."""
    if not has_template(tokenizer):
        return False
    starts, end = _marks(tokenizer)
    return text.lstrip().startswith(tuple(starts)) or bool(end and text.strip().endswith(end))


def chat_prompt(tokenizer: Any, text: str) -> str:
    """``text`` as the user turn of the tokenizer's chat template, ready for the assistant's answer; unchanged
    when the tokenizer has no template or the text already holds it."""
    if not has_template(tokenizer) or is_templated(tokenizer, text):
        return text
    return _render(tokenizer, text)
