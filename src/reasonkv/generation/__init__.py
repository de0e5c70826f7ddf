"""``reasonkv.generate``: batched decoding with an evicting KV cache."""

from __future__ import annotations

from reasonkv.generation.loop import GenerationResult, generate

__all__ = ["GenerationResult", "generate"]
