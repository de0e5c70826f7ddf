"""Occlusion labels against a brute-force reference: one chunk hidden, the whole sequence recomputed
with its own masking (a custom attention function that builds the mask from the chunk bounds)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from transformers.modeling_utils import AttentionInterface

from conftest import VOCAB, tiny_llama, tiny_qwen3
from reasonkv.calibrate.labels import LabelSettings, chunk_bounds, label_trace
from reasonkv.calibrate.traces import Trace

_REFERENCE = "occlusion_reference_for_tests"
_HIDDEN: dict[str, tuple[int, int] | None] = {"chunk": None}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # Independent of the code under test: a python-built mask, the attention written out.
    b, hq, q, d = query.shape
    groups = hq // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scaling = d**-0.5 if scaling is None else scaling
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    allowed = torch.zeros(q, q, dtype=torch.bool)
    chunk = _HIDDEN["chunk"]
    for i in range(q):
        for j in range(i + 1):
            if window is not None and i - j >= window:
                continue
            if chunk is not None and chunk[0] <= j < chunk[1] and i >= chunk[1]:
                continue
            allowed[i, j] = True
    logits = (query.float() @ key.float().transpose(-1, -2)) * scaling
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ value.float()).to(query.dtype).transpose(1, 2).contiguous(), probs


AttentionInterface.register(_REFERENCE, _reference_attention)


def _brute_logprobs(model, ids: list[int], chunk) -> torch.Tensor:
    """lp(t) for t = 1..T-1 with ``chunk`` hidden, by a full forward without any cache."""
    original = model.config._attn_implementation
    _HIDDEN["chunk"] = chunk
    model.config._attn_implementation = _REFERENCE
    for config in (getattr(model.config, "text_config", None),):
        if config is not None:
            config._attn_implementation = _REFERENCE
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
    finally:
        model.config._attn_implementation = original
        _HIDDEN["chunk"] = None
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def _brute_labels(model, trace: Trace, chunk_size: int, horizon: int | None):
    ids, prompt = trace.ids, trace.prompt_length
    full = _brute_logprobs(model, ids, None)
    lp = lambda table, t: float(table[t - 1])  # noqa: E731
    answer = None if trace.answer_span is None else [prompt + trace.answer_span[0], prompt + trace.answer_span[1]]
    out = {"later": [], "later_sum": [], "answer": []}
    for s in range(prompt, len(ids), chunk_size):
        e = min(s + chunk_size, len(ids))
        hidden = _brute_logprobs(model, ids, (s, e))
        stop = len(ids) if horizon is None else min(len(ids), e + 1 + horizon)
        drops = [lp(full, t) - lp(hidden, t) for t in range(e + 1, stop)]
        out["later_sum"].append(sum(drops) if drops else math.nan)
        out["later"].append(sum(drops) / len(drops) if drops else math.nan)
        if answer is not None and answer[0] - 1 >= e:
            out["answer"].append(sum(lp(full, t) - lp(hidden, t) for t in range(*answer)))
        else:
            out["answer"].append(math.nan)
    return out


def _trace(prompt_len=9, trace_len=23, answer=(18, 21), seed=1) -> Trace:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (prompt_len + trace_len,), generator=g).tolist()
    return Trace("t0", ids[:prompt_len], ids[prompt_len:], answer, "reference")


def tiny_gemma3(layers: int = 4):
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return Gemma3ForCausalLM(config).eval()


def _assert_labels(got, want):
    for kind in ("later", "later_sum", "answer"):
        g, w = torch.tensor(got["labels"][kind]), torch.tensor(want[kind])
        assert torch.equal(g.isnan(), w.isnan()), kind
        torch.testing.assert_close(g.nan_to_num(), w.nan_to_num(), atol=2e-5, rtol=1e-4, msg=kind)


@pytest.mark.parametrize(
    ("factory", "chunk_size", "horizon", "batch_size"),
    [
        (tiny_llama, 4, None, 2),  # several groups: the prefix of each group comes from the full cache
        (tiny_llama, 5, 3, 16),  # one group, short horizon, uneven last chunk
        (lambda: tiny_qwen3(kv_heads=1), 3, None, 3),
        (tiny_gemma3, 4, None, 3),  # sliding-window layers get their own mask
    ],
)
def test_labels_equal_brute_force(factory, chunk_size, horizon, batch_size):
    model = factory()
    trace = _trace()
    got = label_trace(model, trace, LabelSettings(chunk_size=chunk_size, horizon=horizon, batch_size=batch_size))
    want = _brute_labels(model, trace, chunk_size, horizon)
    _assert_labels(got, want)
    assert got["chunks"] == [list(c) for c in chunk_bounds(9, 32, chunk_size)]
    assert got["answer_positions"] == [27, 30]
    # the labels are not trivially zero, and the last chunk has nothing after it
    assert max(abs(v) for v in got["labels"]["later"][:-1]) > 1e-4
    assert math.isnan(got["labels"]["later"][-1])


def test_batch_size_does_not_change_labels():
    model, trace = tiny_llama(), _trace(trace_len=30)
    a = label_trace(model, trace, LabelSettings(chunk_size=3, batch_size=1))
    b = label_trace(model, trace, LabelSettings(chunk_size=3, batch_size=32))
    for kind in ("later", "answer"):
        torch.testing.assert_close(
            torch.tensor(a["labels"][kind]).nan_to_num(),
            torch.tensor(b["labels"][kind]).nan_to_num(),
            atol=1e-5,
            rtol=0,
        )


def test_first_token_after_a_chunk_is_unaffected_and_unscored():
    model, trace = tiny_llama(), _trace(answer=None)
    got = label_trace(model, trace, LabelSettings(chunk_size=4, horizon=1))
    want = _brute_labels(model, trace, 4, 1)
    _assert_labels(got, want)
    assert got["scored"][:-1] == [1] * (len(got["chunks"]) - 1)
    assert all(math.isnan(v) for v in got["labels"]["answer"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(chunk_size=0), "chunk_size must be a positive integer"),
        (dict(batch_size=1.5), "batch_size must be a positive integer"),
        (dict(horizon=0), "horizon must be a positive integer or None"),
    ],
)
def test_bad_settings(options, message):
    with pytest.raises(ValueError, match=message):
        LabelSettings(**options)


def test_kernels_without_masks_are_refused():
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="applies an arbitrary mask .*'flash_attention_2'"):
        label_trace(model, _trace())
