"""The oracle: logits with the evicting cache must equal the full-cache logits with the evicted
positions masked out, per (layer, kv-head), for every query of the run.

The reference re-runs the whole sequence without a cache through a test attention kernel that
lets query ``j`` of full-attention layer ``l`` and kv-head ``h`` see exactly the positions the
evicting cache held (for that layer and head) when token ``j`` was processed, plus ``j`` itself.
On hybrid models a sliding-window layer's query ``j`` sees the logical positions ``j - window + 1
.. j`` (the model's own window rule), and linear-attention layers run as they do without a cache.
The kernel reproduces the model's own extras: learned attention sinks (``s_aux``) and soft-capping.

With a quantized tier, the positions held coded when token ``j`` was processed are seen by query ``j``
with the K/V the cache dequantized for them instead of the model's own (the tier's pending tokens, at
full precision, with the model's own); the oracle also checks that those never change while a token is
held and stay within the format's rounding error.
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import AttentionInterface

import reasonkv
from reasonkv.generation.compiled import CompiledDecode
from reasonkv.hf import cache_keyword, layer_kinds, sliding_window

_MASKS: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, T, T] bool
# layer -> ([1, kv_heads, T, T] bool: query j sees key t dequantized, dequantized keys, values [1, kv_heads, T, D])
_QUANTIZED: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_ORIGINAL: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> the model's own keys, values


def _masked_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None, **kwargs
):
    layer = module.layer_idx
    _ORIGINAL[layer] = (key[0].clone(), value[0].clone())
    allowed = _MASKS[layer]
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    allowed = allowed.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    if layer in _QUANTIZED:
        use, key_q, value_q = (t.repeat_interleave(groups, dim=1) for t in _QUANTIZED[layer])
        scores_q = torch.matmul(query.float(), key_q.float().transpose(2, 3)) * scaling
        scores = torch.where(use, scores_q, scores)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:  # learned sinks: one more logit per head in the softmax, then dropped
        sinks = s_aux.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = torch.matmul(probs, value.float())
    if layer in _QUANTIZED:
        out = torch.matmul(probs * ~use, value.float()) + torch.matmul(probs * use, value_q.float())
    out = out.to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register("oracle_masked", _masked_attention)


@torch.inference_mode()
def run_and_check(
    model,
    policy: str,
    prompt: list[int],
    *,
    budget: int,
    buffer: int,
    steps: int,
    atol=1e-4,
    compiled=None,
    slot_bound: int | None = None,
    **kw,
):
    """Decode greedily with eviction, then check every step's logits against the masked reference.

    ``compiled``: a ``torch.compile`` backend to run the decode steps with, as compiled steps over the cache's
    fixed-shape layout (:class:`reasonkv.generation.compiled.CompiledDecode`). ``slot_bound``: the most slots the
    cache may hold (default ``K + B + Q``; an allocation's widest head holds more). Returns the evicting cache.
    """
    num_layers = model.config.num_hidden_layers
    kinds = layer_kinds(model)
    window = sliding_window(model)
    full = [layer for layer in range(num_layers) if kinds[layer] == "full"]
    cache = reasonkv.EvictingCache(budget, buffer, model=model, policy=policy, **kw)
    key = cache_keyword(model)
    tokens = list(prompt)
    held_before: list[dict[int, torch.Tensor]] = []  # per decode step, per full layer: [kv_heads, slots]
    quantized_before: list[dict[int, torch.Tensor]] = []  # the same for the quantized tier alone
    dequantized: dict[int, dict] = {layer: {} for layer in full}  # layer -> (head, position) -> (key, value)
    logits = []
    decode = None if compiled is None else CompiledDecode(model, cache, backend=compiled)
    out = model(input_ids=torch.tensor([tokens]), use_cache=True, **{key: cache})
    logits.append(out.logits[0, -1])
    if slot_bound is None:
        slot_bound = budget + buffer + cache.quantized
    for _ in range(steps):
        assert cache.slots <= max(slot_bound, len(prompt)), cache.slots
        held_before.append({layer: cache.positions(layer)[0].clone() for layer in full})
        quantized_before.append({layer: _record_quantized(cache, layer, dequantized[layer]) for layer in full})
        for layer in range(num_layers):  # sliding layers hold exactly the last window - 1 positions
            if kinds[layer] == "sliding":
                newest = len(tokens) - 1
                want = list(range(max(0, newest - window + 2), newest + 1))
                for head in cache.positions(layer)[0]:
                    assert head[head >= 0].tolist() == want, (layer, head.tolist(), want)
        token = int(logits[-1].argmax())
        tokens.append(token)
        if decode is None:
            logits.append(model(input_ids=torch.tensor([[token]]), use_cache=True, **{key: cache}).logits[0, -1])
        else:
            logits.append(decode(torch.tensor([[token]]))[0])
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
            allowed[:, len(prompt) + step] = _row(held[layer], total, len(prompt) + step)
        _MASKS[layer] = allowed.unsqueeze(0)
        if dequantized[layer]:
            use = torch.zeros(kv_heads, total, total, dtype=torch.bool)
            for step, held in enumerate(quantized_before):
                use[:, len(prompt) + step] = _row(held[layer], total, None)
            (head_dim,) = {k.shape[-1] for k, _ in dequantized[layer].values()}
            keys_q = torch.zeros(kv_heads, total, head_dim, dtype=model.dtype)
            values_q = torch.zeros(kv_heads, total, head_dim, dtype=model.dtype)
            for (head, position), (k, v) in dequantized[layer].items():
                keys_q[head, position], values_q[head, position] = k, v
            _QUANTIZED[layer] = (use.unsqueeze(0), keys_q.unsqueeze(0), values_q.unsqueeze(0))
    original = model.config._attn_implementation
    model.config._attn_implementation = "oracle_masked"
    try:
        reference = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
        if cache.quantized:
            _check_rounding(cache, dequantized)
    finally:
        model.config._attn_implementation = original
        _MASKS.clear()
        _QUANTIZED.clear()
        _ORIGINAL.clear()
    for step, got in enumerate(logits):
        want = reference[len(prompt) - 1 + step]
        torch.testing.assert_close(
            got.float(), want.float(), atol=atol, rtol=0, msg=lambda m, step=step: f"step {step}: {m}"
        )
    return cache


def _row(positions: torch.Tensor, total: int, query: int | None) -> torch.Tensor:
    """``[kv_heads, total]``: True at the held ``positions`` (``[kv_heads, slots]``, -1 = none) and at ``query``."""
    row = torch.zeros(positions.shape[0], total, dtype=torch.bool)
    row.scatter_(1, positions.clamp(min=0), positions >= 0)
    row[:, 0] = (positions == 0).any(-1)  # padding, clamped to 0 above, must not decide position 0
    if query is not None:
        row[:, query] = True
    return row


def _record_quantized(cache, layer: int, seen: dict) -> torch.Tensor:
    """Positions held coded in ``layer`` (``[kv_heads, width]``, -1 elsewhere), noting their dequantized K/V
    in ``seen``; a token's dequantized K/V must never change while it is held."""
    width = cache.low_width
    positions = cache.coded_positions(layer)[0]
    if not width:
        return positions
    keys, values = cache.attended(layer)
    for head in range(positions.shape[0]):
        for slot in range(width):
            position = int(positions[head, slot])
            if position < 0:
                continue
            entry = (keys[0, head, slot].clone(), values[0, head, slot].clone())
            before = seen.setdefault((head, position), entry)
            assert torch.equal(before[0], entry[0]) and torch.equal(before[1], entry[1]), (
                f"layer {layer} head {head}: the dequantized K/V of position {position} changed while held"
            )
    return positions


def _check_rounding(cache, dequantized: dict[int, dict]) -> None:
    """Dequantized K/V stay within the format's rounding error of the model's own, and differ from them."""
    levels = (1 << cache.bits) - 1
    changed = False
    for layer, entries in dequantized.items():
        keys, values = _ORIGINAL[layer]
        for original, index in ((keys, 0), (values, 1)):
            # A group's scale is at most 2 max|x| / levels, so rounding moves a number by at most max|x| / levels.
            bound = float(original.float().abs().max()) / levels * 1.001 + 1e-6
            for (head, position), pair in entries.items():
                error = (pair[index].float() - original[head, position].float()).abs().max()
                assert float(error) <= bound, f"layer {layer}: rounding error {float(error)} above {bound}"
                changed |= bool(error > 0)
    assert changed, "the quantized tier returned the model's own K/V: nothing was quantized"
