"""Decode one prompt with ``full`` and each policy, keeping every eviction: what ``reasonkv inspect`` shows.
An :class:`Inspection` saves to one trace file and loads back, so a page can be built again without decoding.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from reasonkv.cache.evicting import EvictingCache
from reasonkv.cache.spec import CacheSpec
from reasonkv.generation import generate
from reasonkv.generation.inputs import encode_prompts, vocab_size
from reasonkv.generation.progress import Stages
from reasonkv.inspect.trace import Trace, load_trace, save_trace

__all__ = ["Inspection", "Run", "check_compared", "inspect_prompt", "token_pieces"]

_TOKENS = ("prompt_ids", "token_ids", "pieces")  # what a trace file holds of each run beside its trace


@dataclass
class Run:
    """One decode of the prompt: ``pieces`` is the text of every token, prompt then output."""

    name: str
    prompt_ids: list[int]
    token_ids: list[int]
    pieces: list[str]
    trace: Trace

    @property
    def ids(self) -> list[int]:
        """Prompt and output, by logical position."""
        return self.prompt_ids + self.token_ids


@dataclass
class Inspection:
    """The runs of one prompt (``full`` first when it is one of them: the others are compared with it)."""

    model: str
    runs: list[Run]

    def save(self, path: Path | str) -> None:
        """Write the runs (tokens, texts and traces) to one ``.npz`` trace file."""
        saved = ("trace", *_TOKENS)
        save_trace(path, {run.name: {**{k: getattr(run, k) for k in saved}, "model": self.model} for run in self.runs})

    @classmethod
    def load(cls, path: Path | str) -> Inspection:
        entries = load_trace(path)
        missing = [name for name, e in entries.items() if not set(_TOKENS) <= set(e)]
        if missing or not entries:
            raise ValueError(f"{path} holds traces without their tokens ({', '.join(missing) or 'no runs'})")
        runs = [Run(name, e["prompt_ids"], e["token_ids"], e["pieces"], e["trace"]) for name, e in entries.items()]
        return cls(next(iter(entries.values())).get("model", "?"), runs)


def inspect_prompt(
    model,
    tokenizer,
    prompt: str | Sequence[int],
    specs: Sequence[CacheSpec],
    *,
    model_name: str = "",
    max_new_tokens: int = 512,
    chat: bool = True,
    progress: bool = False,
    **sampling,
) -> Inspection:
    """Decode ``prompt`` (text, in the chat template unless ``chat`` is false, as :func:`reasonkv.generate`
    does, or token ids) with the full cache, then with each of ``specs``, keeping traces. Each run is named in
    the page by its policy (so distinct policies); ``model_name`` defaults to the model's class; ``progress``
    prints a line as each run starts and ends (and a bar over its steps on a terminal); ``sampling``
    (``temperature``, ``top_p``, ``top_k``) goes to :func:`reasonkv.generate` (default greedy)."""
    check_compared(specs)
    for spec in specs:  # an allocation the model cannot hold is refused before the full run decodes
        if spec.allocated:
            EvictingCache(spec=spec, model=model).detach()
    [prompt_ids] = encode_prompts(tokenizer, [prompt], vocab_size(model), chat=chat)
    runs = []
    stages = Stages(len(specs) + 1, max_new_tokens, enabled=progress)
    for spec in [CacheSpec("full", seed=specs[0].seed if specs else 0), *specs]:
        stages.start(spec.policy.name)
        [result] = generate(
            model,
            tokenizer,
            [prompt_ids],
            spec,
            max_new_tokens=max_new_tokens,
            **sampling,
            trace=True,
            progress=progress and sys.stderr.isatty(),
        )
        stages.end(result)
        ids = prompt_ids + result.token_ids
        runs.append(Run(spec.policy.name, prompt_ids, result.token_ids, token_pieces(tokenizer, ids), result.trace))
    return Inspection(model_name or type(model).__name__, runs)


def check_compared(specs: Sequence[CacheSpec]) -> None:
    """The runs compared with full are named by their policies: distinct, and none of them full."""
    names = [spec.policy.name for spec in specs]
    if "full" in names or len(set(names)) != len(names):
        raise ValueError(f"policies to compare with full must be distinct and not full itself, got {names}")


def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """The text each token adds, decoded in context (a character split over tokens lands on the last)."""
    pieces: list[str] = []
    for i in range(len(ids)):
        start = max(0, i - 8)
        before = tokenizer.decode(ids[start:i], skip_special_tokens=False) if i > start else ""
        pieces.append(tokenizer.decode(ids[start : i + 1], skip_special_tokens=False)[len(before) :])
    return pieces
