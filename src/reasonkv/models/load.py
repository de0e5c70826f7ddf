""":func:`load_model`: check the settings, tell which kind of name was given, and hand it to its loader."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from reasonkv.models.bundled import ALIASES, BUNDLED, bundled_model, load_bundled
from reasonkv.models.checkpoint import finish, load_directory
from reasonkv.models.devices import resolve_attn_implementation, resolve_device, resolve_dtype
from reasonkv.models.gguf import read_gguf
from reasonkv.models.hub import load_hub_id
from reasonkv.models.shapes import SHAPE_PREFIX, random_model
from reasonkv.suggest import did_you_mean

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["load_model"]


def load_model(
    name: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    progress: bool | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM in eval mode and its tokenizer (with a pad token, eos if the checkpoint defines none, and
    ``padding_side="left"``).

    ``name``: ``"smollm2-135m"`` / ``"default"`` (bundled SmolLM2-135M-Instruct), ``"gemma3-270m"`` (bundled
    Gemma 3 270M, a base model with sliding-window layers), ``"shape:<name>"`` (random weights, see
    :func:`~reasonkv.models.list_shapes`; no tokenizer: ``None``), a ``.gguf`` file, a local checkpoint directory,
    or a hub id. ``dtype``: ``"fp32"``, ``"bf16"``, ``"fp16"`` (or the long names, or a ``torch.dtype``).
    ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (shapes also ``"meta"``). ``attn_implementation``: ``"sdpa"``,
    ``"eager"`` or ``"flash_attention_2"``. ``progress``: transformers' progress bars while the weights load
    (None: when standard error is a terminal, so a log file or a pipe gets none).

    Raises ``ValueError`` (bad dtype, device, attention implementation or shape name; a model file truncated or
    corrupt, or whose weights hold NaN or inf), ``ImportError`` (a bundled model's package, or flash_attn, not
    installed), ``FileNotFoundError`` (a local-looking path that does not exist) or ``OSError`` (a hub id that
    cannot be resolved, at once when the hub cannot be reached and the id is not cached; an unreadable checkpoint
    file; a cache directory that cannot be written).
    """
    name_str = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(name_str, str) or not name_str.strip():
        raise ValueError(f"Model name must be a non-empty string or path, got {name!r}.")
    name_str = name_str.strip()
    if name_str.startswith(SHAPE_PREFIX):
        return random_model(name_str[len(SHAPE_PREFIX) :], dtype, device, attn_implementation), None
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    attn = resolve_attn_implementation(attn_implementation, torch_dtype, dev)
    shown = sys.stderr.isatty() if progress is None else progress
    with _loading_bars(shown):
        return _load_named(name_str, torch_dtype, dev, attn)


@contextmanager
def _loading_bars(shown: bool) -> Iterator[None]:
    """transformers' progress bars on or off for the length of one load (as they were afterwards)."""
    from transformers.utils import logging as transformers_logging

    hide = not shown and transformers_logging.is_progress_bar_enabled()
    if hide:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            transformers_logging.enable_progress_bar()


def _load_named(
    name_str: str, torch_dtype: torch.dtype, dev: torch.device, attn: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A bundled model, a GGUF file, a checkpoint directory or a hub id."""
    bundled = bundled_model(name_str)
    if bundled is not None:
        return load_bundled(bundled, torch_dtype, dev, attn)

    path = Path(name_str).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {name_str!r}.")
        model, tokenizer = read_gguf(path, torch_dtype, attn)
        return finish(model.to(dev), tokenizer)
    if path.is_dir():
        return load_directory(path, torch_dtype, dev, attn)
    if path.exists():
        raise ValueError(f"Cannot load model from {name_str!r}: expected a directory or a .gguf file.")
    if _looks_local(name_str):
        raise FileNotFoundError(f"Model path does not exist: {name_str!r}.")
    # A hub id is the last guess: one that fails and is close to a built-in name was most likely a typo of it.
    hint = did_you_mean(name_str, [*BUNDLED, *ALIASES])
    try:
        return load_hub_id(name_str, torch_dtype, dev, attn)
    except ValueError as error:  # not a hub id at all (its message lists no names)
        if not hint:
            raise
        raise ValueError(f"unknown model {name_str!r}; {hint}built-in names: {', '.join(BUNDLED)}; {error}") from None
    except OSError as error:  # not resolvable (its message lists the built-in names)
        if not hint:
            raise
        raise OSError(f"unknown model {name_str!r}; {hint}{error}") from None


def _looks_local(name: str) -> bool:
    """Whether a name that does not exist was meant as a filesystem path rather than a hub id."""
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~"))
        or name.count("/") > 1
        or "\\" in name
        or name in (".", "..")
    )
