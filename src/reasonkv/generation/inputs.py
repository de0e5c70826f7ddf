"""What ``generate`` is given, checked and turned into token ids: prompts, stop strings, flags."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from reasonkv.generation.chat import chat_prompt

__all__ = ["check_flags", "encode_prompt", "encode_prompts", "eos_ids", "stop_strings", "vocab_size"]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt, with no second BOS when the text (a chat template) already holds one."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def encode_prompts(tokenizer, prompts, vocab: int | None, *, chat: bool) -> list[list[int]]:
    """``prompts`` (one prompt or a list; text or token ids) as token-id lists inside the vocabulary.

    ``chat``: text goes through the tokenizer's chat template first (:func:`~reasonkv.generation.chat.chat_prompt`:
    not when it has none, nor when the text holds it already); token ids are taken as they are.
    """
    encoded = []
    for i, prompt in enumerate(_prompt_list(prompts)):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass token-id lists when tokenizer is None")
            ids = encode_prompt(tokenizer, chat_prompt(tokenizer, prompt) if chat else prompt)
        elif isinstance(prompt, Iterable) and all(_is_token_id(t) for t in prompt):
            ids = [operator.index(t) for t in prompt]
        else:
            raise ValueError(f"prompts[{i}] must be a string or a list of integer token ids, got {prompt!r}")
        if not ids:
            raise ValueError(f"prompts[{i}] is empty")
        outside = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if outside:
            allowed = "ids >= 0" if vocab is None else f"the model's vocabulary is 0..{vocab - 1}"
            raise ValueError(f"prompts[{i}] holds token id {outside[0]}, outside the vocabulary ({allowed})")
        encoded.append(ids)
    return encoded


def _prompt_list(prompts) -> list:
    """``prompts`` as a list of prompts: one string or one token-id sequence counts as a batch of one."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts is None or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a string, a list of strings or a list of token-id lists, got {prompts!r}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    return [prompts] if _is_token_id(prompts[0]) else prompts


def _is_token_id(value) -> bool:
    """An integer (Python, numpy or a 0-d integer tensor), not a bool."""
    if isinstance(value, (bool, str)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def vocab_size(model) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def eos_ids(model, tokenizer) -> set[int]:
    """The end-of-sequence ids of the model's generation config and of the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list: one string is one stop string, not a list of characters."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, Iterable) else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if "" in stops:
        raise ValueError("stop strings must not be empty: '' would end every row at its first token")
    return stops


def check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
