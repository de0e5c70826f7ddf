"""Loading a checkpoint directory (a user's, a hub id's snapshot, or a bundled model's converted copy), and
:func:`finish`, which every loader that returns a tokenizer applies last."""

from __future__ import annotations

import logging
import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonkv.models.devices import clear_attention_error
from reasonkv.models.files import CorruptModelError, check_finite, is_corrupt_file_error

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["finish", "load_directory"]

logger = logging.getLogger(__name__)


def load_directory(
    path: Path | str, dtype: torch.dtype, device: torch.device, attn: str, *, local_files_only: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer from a checkpoint directory or a hub id: :class:`CorruptModelError` when a file
    there is truncated or corrupt, or the weights hold NaN or inf values."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # device_map places the weights straight on the GPU instead of staging them on the CPU.
    device_kwargs: dict[str, Any] = {} if device.type == "cpu" else {"device_map": {"": device}}
    try:
        with clear_attention_error(attn), warnings.catch_warnings():
            # torch warns, with a line of its own source, about a pickle protocol it then refuses: the refusal
            # below says it in one line
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn, local_files_only=local_files_only, **device_kwargs
            )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)
    except Exception as error:
        if not is_corrupt_file_error(error):
            raise
        if isinstance(error, pickle.UnpicklingError):
            # torch's own message suggests loading it with weights_only=False, which runs whatever it holds
            raise CorruptModelError(
                f"cannot load the model in {str(path)!r}: a pickled weights file there (.bin or .pt) holds more than "
                "weights (torch's weights-only loader refused it: it is damaged, or it would run code), so it was "
                "not loaded; use the model's safetensors files, or a copy from a source you trust"
            ) from None
        raise CorruptModelError(
            f"cannot load the model in {str(path)!r}: a file there is truncated or corrupt "
            f"({type(error).__name__}: {error})"
        ) from error
    check_finite(model, f"the model in {str(path)!r}")
    return finish(model, tokenizer)


def finish(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model in eval mode; the tokenizer with a pad token and left padding, ready for batched prompts."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            logger.warning("Tokenizer has neither a pad nor an eos token; batched inputs cannot be padded.")
    # Left padding keeps every prompt's last token at the end of the row, where decoding continues.
    tokenizer.padding_side = "left"
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer
