"""Model files for the loading tests: a tiny checkpoint directory, and two ways to damage a weights file."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

from conftest import tiny_llama


def save_tiny_checkpoint(directory: Path) -> Path:
    """A tiny Llama and a word-level tokenizer, saved as a regular checkpoint directory."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tiny_llama().save_pretrained(directory)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "thought", "about", "it"]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: 3 + i for i, w in enumerate(words)}}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(directory)
    return directory


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def poison(path: Path) -> None:
    """Write NaN into one weight tensor of a safetensors file, keeping its size and structure."""
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if n.endswith("mlp.up_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
