"""The model's context length, and the check that a prompt and the tokens it may generate fit in it.

The model was never trained past ``max_position_embeddings`` (tokens keep their positions under eviction), so
its output there is noise: ``eval`` and the ``generate``, ``inspect`` and ``demo`` commands refuse such a prompt
before decoding, with one message; ``reasonkv.generate`` warns (it can be what an experiment is after).
"""

from __future__ import annotations

from collections.abc import Sequence

from reasonkv.hf import text_config
from reasonkv.suggest.integers import is_int

__all__ = ["check_context", "context_length", "over_context"]


def context_length(model) -> int | None:
    """The model's context length (``max_position_embeddings``), when its config says."""
    length = getattr(text_config(model), "max_position_embeddings", None)
    return length if is_int(length) and length > 0 else None


def over_context(prompt_tokens: int, new_tokens: int, context: int | None, advice: str) -> str | None:
    """Why a prompt of ``prompt_tokens`` and up to ``new_tokens`` more do not fit ``context``, or ``None``."""
    if context is None or prompt_tokens + new_tokens <= context:
        return None
    return (
        f"the prompt ({prompt_tokens:,} tokens) and up to {new_tokens:,} new tokens ({prompt_tokens + new_tokens:,}) "
        f"exceed the model's context of {context:,} tokens (max_position_embeddings); {advice}"
    )


def check_context(
    model,
    prompt_ids: Sequence[Sequence[int]],
    new_tokens: int,
    advice: str = "shorten the prompt or lower --max-new-tokens",
) -> None:
    """Refuse, before decoding, the first prompt that does not fit the model's context with ``new_tokens``."""
    context = context_length(model)
    for i, ids in enumerate(prompt_ids):
        why = over_context(len(ids), new_tokens, context, advice)
        if why is not None:
            which = f"prompt {i + 1} of {len(prompt_ids)}: " if len(prompt_ids) > 1 else ""
            raise ValueError(f"checked before decoding: {which}{why}")
