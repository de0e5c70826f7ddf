"""Loading a GGUF file: transformers dequantises it into an ordinary model, after reasonkv checks the file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from reasonkv.models.devices import clear_attention_error
from reasonkv.models.files import CorruptModelError, check_finite, check_gguf_header, gguf_damage
from reasonkv.runs.oom import is_out_of_memory

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["read_gguf"]


def read_gguf(gguf: Path, dtype: torch.dtype, attn: str = "sdpa") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer of a GGUF file that may be damaged, on the CPU: its header checked before the (slow)
    load, its structure diagnosed if the load fails, its weights checked for NaN and inf after
    (:class:`CorruptModelError`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_header(gguf)
    try:
        with clear_attention_error(attn):
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=dtype, attn_implementation=attn
            )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _align_special_tokens(tokenizer, model.config)
        # The weights are already dequantised; dropping the quantizer makes this an ordinary model, so it
        # can be saved, cast and moved like any other.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    except Exception as error:
        if is_out_of_memory(error):
            raise
        damage = gguf_damage(gguf)
        if damage is None:
            raise
        raise CorruptModelError(f"GGUF file {str(gguf)!r} is truncated or corrupt: {damage}") from None
    check_finite(model, f"GGUF file {str(gguf)!r}")
    return model, tokenizer


def _align_special_tokens(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> None:
    """Set the tokenizer's bos/eos/pad/unk tokens to the ids the GGUF metadata gave the model config: some
    transformers releases (5.17) build the GGUF tokenizer with a wrong eos (``<|im_start|>`` for SmolLM2) and no
    pad token, while the config read from the same file is right."""
    vocab_size = len(tokenizer)
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, f"{role}_token") != token:
            setattr(tokenizer, f"{role}_token", token)
