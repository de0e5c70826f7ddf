"""A tiny model saved as a checkpoint, for tests that run ``reasonkv eval`` as a separate process."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def save_tiny_checkpoint(path: Path) -> Path:
    """A 2-layer Llama with a byte-level tokenizer, saved in ``path`` as a checkpoint the command line loads."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=None, pad_token_id=vocab["<eos>"],
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path
