"""``reasonkv calibrate --budgets``: the budget file of ``allocation="calibrated"``, from attention mass.

Each (layer, kv-head) is weighted by the attention mass its queries pay beyond what a streaming head holds (the
first ``sinks`` keys and the ``window`` most recent), the model's own softmax recomputed from the attention tap
(docs/calibrate.md). The file (:class:`reasonkv.cache.allocation.BudgetFile`) holds these ``weights``, shared out
in proportion by the cache, so one file serves every budget.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from reasonkv.cache.allocation import load_budget_file
from reasonkv.calibrate.reading import ReadingSettings, read_sequences
from reasonkv.calibrate.shared import traces_setting
from reasonkv.hf import AttentionTap, model_info
from reasonkv.policies import attention
from reasonkv.runs.flags import setting
from reasonkv.runs.paths import portable_command

__all__ = ["BUDGETS_GROUP", "BudgetsSettings", "head_mass", "run_budgets"]

BUDGETS_GROUP = "budgets per (layer, kv-head) (allocation='calibrated')"  # the flags' group on the command line

CHUNK = 256  # queries whose attention rows are built at once


@dataclass(frozen=True, kw_only=True)
class BudgetsSettings(ReadingSettings):
    """Everything one ``reasonkv calibrate --budgets`` run is told: what :class:`ReadingSettings` holds, and the
    streaming head's share (the first ``sinks`` keys and the ``window`` most recent): the mass beyond it is what a
    head needs the rest of its budget for."""

    FLAG: ClassVar[str] = "--budgets"
    FILE_KIND: ClassVar[str] = "budget file"
    COUNTS: ClassVar[tuple[tuple[str, int], ...]] = (("sinks", 0), ("window", 1))

    traces: int = traces_setting(16)
    sinks: int = setting(
        4,
        group=BUDGETS_GROUP,
        name="--budget-sinks",
        type=int,
        help="with --budgets: the streaming head's first keys (default 4)",
    )
    window: int = setting(
        64,
        group=BUDGETS_GROUP,
        name="--budget-window",
        type="positive",
        help="with --budgets: the streaming head's most recent keys (default 64)",
    )

    def _load_existing(self, path: Path) -> None:
        load_budget_file(path)


def _beyond_window(query, key, kernel: attention.Kernel, sinks: int, window: int) -> tuple[torch.Tensor, int]:
    """Per kv head, the attention mass of one sequence's queries on keys ``sinks <= j <= t - window`` (query
    ``t``), summed over the queries that have such keys and averaged over each kv head's query heads; and how
    many queries that is. The softmax is the ``kernel``'s own (its learned sinks share it and are dropped)."""
    length = query.shape[2]
    kv_heads = key.shape[1]
    first = sinks + window  # the first query with a key beyond the window
    total = torch.zeros(kv_heads, dtype=torch.float64, device=query.device)
    if length <= first:
        return total, 0
    keys = key.float()
    slot = torch.arange(length, device=query.device)
    for start in range(first, length, CHUNK):
        part = query[:, :, start : start + CHUNK]
        n = part.shape[2]
        t = start + torch.arange(n, device=query.device).view(-1, 1)
        logits = attention.grouped_logits(part, keys, kernel.scaling, kernel.softcap)  # [1, kv_heads, g, n, length]
        extra = None if kernel.sinks is None else attention.grouped_sinks(kernel.sinks, kv_heads)
        probs = attention.masked_softmax_(logits, (slot.view(1, -1) <= t).view(1, 1, 1, n, length), extra)
        far = (slot.view(1, -1) >= sinks) & (slot.view(1, -1) <= t - window)
        mass = (probs * far.view(1, 1, 1, n, length)).sum(-1)  # [1, kv_heads, g, n]
        total += mass.mean(2).sum(-1)[0].double()
    return total, length - first


@torch.inference_mode()
def head_mass(model, sequences: list[list[int]], *, sinks: int, window: int) -> tuple[torch.Tensor, int]:
    """``[full-attention layers, kv_heads]``: the mean attention mass beyond a streaming head's ``sinks`` and
    ``window`` per query, and how many queries it averages."""
    info = model_info(model)
    layers = info.full_layers
    index = {layer: i for i, layer in enumerate(layers)}
    device = next(model.parameters()).device
    sums = torch.zeros(len(layers), info.num_kv_heads, dtype=torch.float64)
    counted = {"queries": 0}

    def listen(layer, query, key, mask, kwargs) -> None:
        if layer not in index:
            return
        mass, queries = _beyond_window(query, key, attention.Kernel.of(query, kwargs), sinks, window)
        sums[index[layer]] += mass.cpu()
        if index[layer] == 0:
            counted["queries"] += queries

    with AttentionTap(model, listen):
        for ids in sequences:
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    if counted["queries"] == 0:
        raise ValueError(f"no trace is longer than sinks + window = {sinks + window} tokens: nothing to measure")
    return sums / counted["queries"], counted["queries"]


def run_budgets(settings: BudgetsSettings) -> int:
    """Measure and write the budget file ``settings`` describe; returns 0."""
    model, tokenizer = settings.load()
    sequences = read_sequences(settings, tokenizer)
    weights, queries = head_mass(model, sequences, sinks=settings.sinks, window=settings.window)
    layers, kv_heads = weights.shape
    record = {
        "layers": layers,
        "kv_heads": kv_heads,
        "weights": [[round(float(w), 6) for w in row] for row in weights],
        "measure": (
            f"mean attention mass on the keys after the first {settings.sinks} and before the {settings.window} "
            "most recent, per query, averaged over each kv head's query heads"
        ),
        "model": settings.model,
        "source": settings.source,
        "queries": queries,
        "command": portable_command(settings.command(), settings.out.parent),
    }
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    settings.out.write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"calibrate --budgets: {layers} layers x {kv_heads} kv-heads from {queries} queries per head "
        f"({settings.source}); wrote {settings.out}",
        file=sys.stderr,
    )
    return 0
