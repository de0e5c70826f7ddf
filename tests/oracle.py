"""The oracle: logits with the evicting cache must equal the full-cache logits with the evicted
positions masked out, per (layer, kv-head), for every query of the run.

The reference re-runs the whole sequence without a cache through a test attention kernel that
lets query ``j`` of full-attention layer ``l`` and kv-head ``h`` see exactly the positions the
evicting cache held (for that layer and head) when token ``j`` was processed, plus ``j`` itself.
On hybrid models a sliding-window layer's query ``j`` sees the logical positions ``j - window + 1
.. j`` (the model's own window rule), and linear-attention layers run as they do without a cache.
The kernel reproduces the model's own extras: learned attention sinks (``s_aux``) and soft-capping.
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import AttentionInterface

import reasonkv
from reasonkv.hf import cache_keyword, layer_kinds, sliding_window

_MASKS: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, T, T] bool


def _masked_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None, **kwargs
):
    allowed = _MASKS[module.layer_idx]
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    allowed = allowed.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:  # learned sinks: one more logit per head in the softmax, then dropped
        sinks = s_aux.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = torch.matmul(probs, value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register("oracle_masked", _masked_attention)


@torch.inference_mode()
def run_and_check(model, policy: str, prompt: list[int], *, budget: int, buffer: int, steps: int, atol=1e-4, **kw):
    """Decode greedily with eviction, then check every step's logits against the masked reference.

    Returns the evicting cache (for further assertions) and the number of evictions.
    """
    num_layers = model.config.num_hidden_layers
    kinds = layer_kinds(model)
    window = sliding_window(model)
    full = [layer for layer in range(num_layers) if kinds[layer] == "full"]
    cache = reasonkv.EvictingCache(budget, buffer, model=model, policy=policy, **kw)
    key = cache_keyword(model)
    tokens = list(prompt)
    held_before: list[dict[int, torch.Tensor]] = []  # per decode step, per full layer: [kv_heads, slots]
    logits = []
    out = model(input_ids=torch.tensor([tokens]), use_cache=True, **{key: cache})
    logits.append(out.logits[0, -1])
    slot_bound = budget + buffer
    for _ in range(steps):
        assert cache.slots <= max(slot_bound, len(prompt)), cache.slots
        held_before.append({layer: cache.positions(layer)[0].clone() for layer in full})
        for layer in range(num_layers):  # sliding layers hold exactly the last window - 1 positions
            if kinds[layer] == "sliding":
                newest = len(tokens) - 1
                want = list(range(max(0, newest - window + 2), newest + 1))
                for head in cache.positions(layer)[0]:
                    assert head[head >= 0].tolist() == want, (layer, head.tolist(), want)
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{key: cache})
        logits.append(out.logits[0, -1])
        assert cache.slots <= slot_bound
    cache.detach()

    total = len(tokens)
    kv_heads = cache.positions(full[0]).shape[1]
    order = torch.arange(total)
    for layer in range(num_layers):
        allowed = torch.tril(torch.ones(total, total, dtype=torch.bool)).expand(kv_heads, -1, -1).clone()
        if kinds[layer] != "full":
            if kinds[layer] == "sliding":  # the model's window rule, over logical positions
                allowed &= (order.view(-1, 1) - order.view(1, -1)) < window
            _MASKS[layer] = allowed.unsqueeze(0)
            continue
        for step, held in enumerate(held_before):
            j = len(prompt) + step
            row = torch.zeros(kv_heads, total, dtype=torch.bool)
            positions = held[layer]
            row.scatter_(1, positions.clamp(min=0), positions >= 0)
            row[:, j] = True
            allowed[:, j] = row
        _MASKS[layer] = allowed.unsqueeze(0)
    original = model.config._attn_implementation
    model.config._attn_implementation = "oracle_masked"
    try:
        reference = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    finally:
        model.config._attn_implementation = original
        _MASKS.clear()
    for step, got in enumerate(logits):
        want = reference[len(prompt) - 1 + step]
        torch.testing.assert_close(
            got.float(), want.float(), atol=atol, rtol=0, msg=lambda m, step=step: f"step {step}: {m}"
        )
    return cache
