"""The length sweep's compiled variants (``--compile``): each policy decoded eagerly and compiled, side by side.

A compiled variant ``POLICY~compiled`` runs the policy's decode steps as one fixed-shape graph each
(:class:`~reasonkv.generation.compiled.CompiledDecode`), the evictions between them eager. Its reference
pair is plain transformers: ``transformers`` (its own dynamic cache, eager) and ``transformers~compiled``
(a ``StaticCache`` and ``torch.compile`` of the model's forward, as transformers compiles decoding), the
same prompts, steps and timing. The summary sets, per batch size and length, each policy's compiled
tokens/s against its eager tokens/s and against ``transformers~compiled``; the time spent compiling is
reported apart and never inside tokens/s (the steps that traced a graph are left out of every window).
"""

from __future__ import annotations

import torch

from reasonkv.bench.markdown import cell, per_batch
from reasonkv.bench.rounds import same_rounds
from reasonkv.bench.windows import by_length
from reasonkv.generation.compiled import GRAPH_LIMITS, compile_mode, compiled_function
from reasonkv.hf import Forward, static_cache

__all__ = ["COMPILED", "StaticReference", "compiled_label", "compiled_markdown", "compiled_summary"]

COMPILED = "~compiled"


def compiled_label(entry: str) -> str:
    """``snapkv~compiled``: the name a compiled variant is measured and reported under."""
    return entry + COMPILED


def _static_logits(model, cache_key: str, input_ids, position_ids, cache) -> torch.Tensor:
    inputs = {cache_key: cache, "position_ids": position_ids}
    return model.forward(input_ids=input_ids, use_cache=True, logits_to_keep=1, **inputs).logits[:, -1]


class StaticReference:
    """Plain transformers decoding compiled: a ``StaticCache`` of ``capacity`` slots per row, the prefill eager
    and each single-token step through ``torch.compile`` of the model's forward (CUDA graphs on a GPU).

    ``prefill(ids)`` and ``step(ids)`` return the newest logits ``[batch, vocab]``; :attr:`cache` is the
    ``StaticCache``.
    """

    def __init__(self, model, capacity: int, *, backend: str):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = static_cache(model, capacity)
        self.mode = compile_mode(self.device, backend)
        self._forward = Forward(model)
        self._graph = compiled_function(_static_logits, backend, self.mode)
        self._length = 0

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self._length += ids.shape[1]
        return self._forward(ids, self.cache, last_logits_only=True).logits[:, -1]

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.full((ids.shape[0], 1), self._length, dtype=torch.long, device=self.device)
        with GRAPH_LIMITS:
            logits = self._graph(self.model, self._forward.cache_key, ids, positions, self.cache)
        self._length += 1
        return logits.clone() if self.mode == "reduce-overhead" else logits  # a CUDA graph reuses its output


def compiled_summary(records: list[dict]) -> dict:
    """Per batch (as a string) and compiled variant: tokens/s eager and compiled at each length both reached,
    compiled over eager, compiled over ``transformers~compiled``, and the compilation (warm-up seconds,
    graphs, and why a cache decoded eagerly, if it did)."""
    sweeps = [r for r in records if r.get("mode") == "sweep"]
    find = {(r["policy"], r["batch"]): r for r in sweeps}
    out: dict = {}
    for record in sweeps:
        if not record["policy"].endswith(COMPILED):
            continue
        policy = record["policy"][: -len(COMPILED)]
        eager = find.get((policy, record["batch"]))
        if eager is None or not same_rounds(record, eager):  # a ratio only between entries of the same rounds
            continue
        mine, theirs = by_length(record), by_length(eager)
        reference = find.get(("transformers" + COMPILED, record["batch"]))
        static = by_length(reference) if reference is not None and same_rounds(record, reference) else {}
        common = sorted(set(mine) & set(theirs))
        compile_info = record.get("compile") or {}
        out.setdefault(str(record["batch"]), {})[record["policy"]] = {
            "policy": policy,
            "eager_tokens_per_s": {n: theirs[n]["tokens_per_s"] for n in common},
            "compiled_tokens_per_s": {n: mine[n]["tokens_per_s"] for n in common},
            "compiled_vs_eager": {n: mine[n]["tokens_per_s"] / theirs[n]["tokens_per_s"] for n in common},
            "vs_transformers_compiled": {
                n: mine[n]["tokens_per_s"] / static[n]["tokens_per_s"] for n in common if n in static
            },
            "warmup_seconds": compile_info.get("warmup_seconds"),
            "compilations": compile_info.get("compilations"),
            "eager_reason": compile_info.get("eager_reason"),
        }
    return out


def compiled_markdown(summary: dict) -> list[str]:
    """The comparison as markdown tables, one per batch size, and a sentence per cache that ran eagerly."""
    return per_batch(
        summary,
        "Compiled against eager decoding",
        "Tokens/s of each entry's decode steps run eagerly and as one compiled graph per step, in the same "
        "run. The steps that compiled a graph are left out of tokens/s; their time is the warm-up. The last "
        "column sets the compiled entry against plain transformers compiled (a StaticCache and torch.compile "
        "of the model's forward) at the same length.",
        [
            "entry",
            "length",
            "eager tok/s",
            "compiled tok/s",
            "compiled / eager",
            "warm-up s (graphs)",
            "vs transformers~compiled",
        ],
        _compiled_rows,
        notes=lambda variants: [
            f"{label} decoded eagerly: {s['eager_reason']}." for label, s in variants.items() if s["eager_reason"]
        ],
    )


def _compiled_rows(variants: dict) -> list[list[str]]:
    rows = []
    for s in variants.values():
        warmup = f"{cell(s['warmup_seconds'], '{:.1f}')} ({cell(s['compilations'], '{}')})"
        for n, ratio in s["compiled_vs_eager"].items():
            eager, graph = s["eager_tokens_per_s"][n], s["compiled_tokens_per_s"][n]
            vs = cell(s["vs_transformers_compiled"].get(n), "{:.3f}")
            rows.append([s["policy"], str(n), f"{eager:.1f}", f"{graph:.1f}", f"{ratio:.3f}", warmup, vs])
    return rows
