"""A reference for ``reasonkv calibrate --budgets``: the attention mass each (full-attention layer, kv-head) pays
beyond the sinks and the recent window, read from the eager kernel's own attention weights."""

from __future__ import annotations

import torch

from reasonkv.hf import layer_kinds


def eager_head_mass(model, sequences, sinks: int, window: int) -> torch.Tensor:
    """``[full-attention layers, kv_heads]``: the mean over queries (past ``sinks + window``) of the mass on keys
    after the first ``sinks`` and at least ``window`` back, averaged over each kv head's query heads."""
    config = model.config
    kv_heads, heads = config.num_key_value_heads, config.num_attention_heads
    full = [i for i, kind in enumerate(layer_kinds(model)) if kind == "full"]
    sums = torch.zeros(len(full), kv_heads, dtype=torch.float64)
    queries = 0
    original = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        for ids in sequences:
            out = model(input_ids=torch.tensor([ids]), use_cache=False, output_attentions=True)
            t, slot = torch.arange(len(ids)).view(-1, 1), torch.arange(len(ids)).view(1, -1)
            far = ((slot >= sinks) & (slot <= t - window)).double()
            for row, layer in enumerate(full):  # attentions[layer]: [1, heads, length, length]
                mass = (out.attentions[layer][0].double() * far).sum(-1)[:, sinks + window :]  # [heads, queries]
                sums[row] += mass.view(kv_heads, heads // kv_heads, -1).mean(1).sum(-1)
            queries += max(0, len(ids) - sinks - window)
    finally:
        config._attn_implementation = original
    return sums / queries
