"""Expected Attention: scores against the formula written out with explicit matrices (kvpress's way) on
fixed tensors; the recorded queries it reads (kvpress's decoding buffer, or the window across evictions)."""

from __future__ import annotations

import math

import pytest
import torch

import reasonkv
from fixed_view import FixedCache, fixed_view, hf_rotate, hf_tables, model_info
from reasonkv.policies.contract import Needs
from reasonkv.policies.recorded import Recorded
from reasonkv.policies.rotary import Rotary

HEADS, KV_HEADS, DIM, SLOTS, WINDOW = 4, 2, 8, 14, 10
INV_FREQ = 1.0 / (100.0 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
SCALING = 1.2


def _rotation_matrices(positions: torch.Tensor) -> torch.Tensor:
    """``R(p) = cos·I + sin·P`` per position (kvpress builds the same from the model's tables)."""
    cos, sin = hf_tables(INV_FREQ, SCALING, positions)
    eye = torch.eye(DIM)
    swap = torch.zeros(DIM, DIM)
    swap[DIM // 2 :, : DIM // 2] = torch.eye(DIM // 2)
    swap[: DIM // 2, DIM // 2 :] = -torch.eye(DIM // 2)
    return cos.unsqueeze(-1) * eye + sin.unsqueeze(-1) * swap


def _reference(keys, values, queries, q_positions, t, n_future, sinks, positions, counted=None):
    """kvpress's expected attention: μ, Σ of the pre-RoPE queries (``counted``, else those at positions
    ``>= sinks``), R̄ over t..t+n-1, exp-logits softmax over the non-sink keys, group mean, times ‖v‖."""
    inverse = torch.linalg.inv(_rotation_matrices(q_positions))  # [w, d, d]: undo each query's rotation
    pre = torch.einsum("wij,hwj->hwi", inverse, queries[0])
    keep = q_positions >= sinks if counted is None else counted
    pre = pre[:, keep]
    mu = pre.mean(1)
    centered = pre - mu.unsqueeze(1)
    cov = centered.transpose(1, 2) @ centered / pre.shape[1]
    average = _rotation_matrices(torch.arange(t, t + n_future)).mean(0)
    mu = mu @ average.T
    cov = average @ cov @ average.T
    group = HEADS // KV_HEADS
    k = keys[0].repeat_interleave(group, dim=0)  # [heads, slots, d]
    logits = (k @ mu.unsqueeze(-1)).squeeze(-1) / math.sqrt(DIM)
    logits += torch.einsum("hsi,hij,hsj->hs", k, cov, k) / DIM / 2
    candidates = positions >= sinks
    probs = torch.zeros_like(logits)
    probs[:, candidates] = torch.softmax(logits[:, candidates], dim=-1)
    probs = probs.view(KV_HEADS, group, SLOTS).mean(1)
    return probs * values[0].norm(dim=-1)


@pytest.mark.parametrize("covariance", [True, False])
def test_scores_equal_the_formula_on_fixed_tensors(covariance):
    g = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 1, 2, 3, 10, 11, 15, 19, 22, 23, 27, 28, 29, 30])
    slots = positions.view(1, 1, SLOTS).expand(1, KV_HEADS, SLOTS)
    keys = hf_rotate(torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g), INV_FREQ, SCALING, slots)
    values = torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g)
    q_positions = torch.arange(21, 31)  # the last WINDOW queries
    pre_queries = torch.randn(1, HEADS, WINDOW, DIM, generator=g) + 0.5
    queries = hf_rotate(pre_queries, INV_FREQ, SCALING, q_positions)
    options = dict(query_window=WINDOW, n_future_positions=16, use_covariance=covariance, query_span="window")
    policy = reasonkv.get_policy("expected-attention", **options)
    assert policy.needs(None) == Needs(query_window=WINDOW)
    info = model_info(1, HEADS, KV_HEADS, DIM, Rotary("yarn", tuple(INV_FREQ.tolist()), SCALING, "half", DIM))
    policy.reset(info, 1, torch.device("cpu"))
    recorded = Recorded(WINDOW)
    recorded.push_queries(0, queries, q_positions.unsqueeze(0), torch.ones(1, WINDOW, dtype=torch.bool))
    view = fixed_view(FixedCache([keys], [values], slots, budget=6), policy, info, recorded=recorded)
    got = policy.score(view)[0]
    expected = _reference(keys, values, queries, q_positions, 31, 16, policy.sinks, positions)
    if not covariance:
        expected = _reference_without_covariance(keys, values, queries, q_positions, 31, 16, policy.sinks, positions)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def _reference_without_covariance(keys, values, queries, q_positions, t, n_future, sinks, positions):
    inverse = torch.linalg.inv(_rotation_matrices(q_positions))
    pre = torch.einsum("wij,hwj->hwi", inverse, queries[0])[:, q_positions >= sinks]
    mu = pre.mean(1) @ _rotation_matrices(torch.arange(t, t + n_future)).mean(0).T
    group = HEADS // KV_HEADS
    k = keys[0].repeat_interleave(group, dim=0)
    logits = (k @ mu.unsqueeze(-1)).squeeze(-1) / math.sqrt(DIM)
    candidates = positions >= sinks
    probs = torch.zeros_like(logits)
    probs[:, candidates] = torch.softmax(logits[:, candidates], dim=-1)
    return probs.view(KV_HEADS, group, SLOTS).mean(1) * values[0].norm(dim=-1)


def test_queries_at_sink_positions_and_padding_do_not_count_in_the_window_span():
    """``query_span="window"``: a window padded on the left, and queries at the sink positions, leave the
    scores unchanged."""
    g = torch.Generator().manual_seed(4)
    positions = torch.arange(SLOTS).view(1, 1, SLOTS).expand(1, KV_HEADS, SLOTS)
    keys = torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g)
    values = torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g)
    info = model_info(1, HEADS, KV_HEADS, DIM, Rotary("default", tuple(INV_FREQ.tolist()), 1.0, "half", DIM))
    queries = torch.randn(1, HEADS, 6, DIM, generator=g)
    scores = []
    for extra in (0, 3):  # 3 more queries at positions 0..2 (sinks) in front
        policy = reasonkv.get_policy("expected-attention", query_window=9, query_span="window")
        policy.reset(info, 1, torch.device("cpu"))
        recorded = Recorded(9)
        q = torch.cat([torch.randn(1, HEADS, extra, DIM, generator=g), queries], dim=2)
        pos = torch.cat([torch.arange(extra), torch.arange(8, 14)]).unsqueeze(0)
        recorded.push_queries(0, q, pos, torch.ones_like(pos, dtype=torch.bool))
        view = fixed_view(FixedCache([keys], [values], positions, budget=6), policy, info, recorded=recorded)
        scores.append(policy.score(view))
    torch.testing.assert_close(scores[0], scores[1])


def _decoding_view(policy, info, recorded, *, newest: int, evictions: int, prompt: int):
    """A one-row view at an eviction of a row whose newest token is at ``newest``, evicted ``evictions``
    times before."""
    positions = torch.arange(newest - SLOTS + 1, newest + 1).view(1, 1, SLOTS).expand(1, KV_HEADS, SLOTS)
    cache = FixedCache(
        [torch.zeros(1, KV_HEADS, SLOTS, DIM)], [torch.ones(1, KV_HEADS, SLOTS, DIM)], positions, budget=6
    )
    cache.prompt_lengths = torch.tensor([prompt])
    cache.row_evictions = torch.tensor([evictions])
    return fixed_view(cache, policy, info, recorded=recorded)


def _counted(policy, view) -> list[int]:
    _, positions, valid = view.recent_queries()
    return positions[0][policy.query_weights(view, positions, valid)[0]].tolist()


def test_the_default_span_is_kvpress_decoding_buffer_cleared_at_each_eviction():
    """kvpress's ``DecodingPress`` clears its buffer at every compression and its press drops the first
    ``n_sink`` buffered states: at an eviction the statistics come from the tokens decoded since the
    previous one, less the oldest ``sinks`` (``min(B, 256) - 4`` queries, 124 at B = 128)."""
    info = model_info(1, HEADS, KV_HEADS, DIM, Rotary("default", tuple(INV_FREQ.tolist()), 1.0, "half", DIM))
    policy = reasonkv.get_policy("expected-attention")
    assert (policy.query_span, policy.query_window, policy.sinks) == ("since-eviction", 256, 4)
    policy.reset(info, 1, torch.device("cpu"))

    def recorded_up_to(newest: int) -> Recorded:
        recorded = Recorded(policy.query_window)
        start = max(0, newest + 1 - policy.query_window)
        pos = torch.arange(start, newest + 1).unsqueeze(0)
        recorded.push_queries(0, torch.randn(1, HEADS, pos.shape[1], DIM), pos, torch.ones_like(pos, dtype=torch.bool))
        return recorded

    prompt = 100
    # Right after prefill (a long prompt): no decoded query yet, so the prompt's, as the window span reads them.
    view = _decoding_view(policy, info, recorded_up_to(prompt - 1), newest=prompt - 1, evictions=0, prompt=prompt)
    assert _counted(policy, view) == list(range(4, prompt))
    # The first decode eviction, B = 128 tokens later: the tokens decoded since, less the oldest 4.
    view = _decoding_view(policy, info, recorded_up_to(prompt + 127), newest=prompt + 127, evictions=1, prompt=prompt)
    assert _counted(policy, view) == list(range(prompt + 4, prompt + 128))
    assert len(_counted(policy, view)) == 124  # every layer of the same eviction reads the same span
    # The next, 128 later: only what came since the previous eviction.
    view = _decoding_view(policy, info, recorded_up_to(prompt + 255), newest=prompt + 255, evictions=2, prompt=prompt)
    assert _counted(policy, view) == list(range(prompt + 132, prompt + 256))
    # B = 300 > 256: the recorded queries are the most kvpress's buffer holds, min(B, 256) - 4.
    view = _decoding_view(policy, info, recorded_up_to(prompt + 555), newest=prompt + 555, evictions=3, prompt=prompt)
    assert len(_counted(policy, view)) == 252


def test_the_window_span_reads_the_last_queries_across_evictions():
    info = model_info(1, HEADS, KV_HEADS, DIM, Rotary("default", tuple(INV_FREQ.tolist()), 1.0, "half", DIM))
    policy = reasonkv.get_policy("expected-attention", query_span="window", query_window=32)
    policy.reset(info, 1, torch.device("cpu"))
    recorded = Recorded(32)
    pos = torch.arange(168, 200).unsqueeze(0)
    recorded.push_queries(0, torch.randn(1, HEADS, 32, DIM), pos, torch.ones_like(pos, dtype=torch.bool))
    view = _decoding_view(policy, info, recorded, newest=199, evictions=5, prompt=20)
    assert _counted(policy, view) == list(range(168, 200))


def test_scores_of_the_default_span_equal_the_formula_over_the_queries_since_the_previous_eviction():
    g = torch.Generator().manual_seed(5)
    info = model_info(1, HEADS, KV_HEADS, DIM, Rotary("yarn", tuple(INV_FREQ.tolist()), SCALING, "half", DIM))
    policy = reasonkv.get_policy("expected-attention", query_window=WINDOW, n_future_positions=16)
    policy.reset(info, 1, torch.device("cpu"))
    positions = torch.tensor([0, 1, 2, 3, 10, 11, 15, 19, 22, 23, 27, 28, 29, 30])
    slots = positions.view(1, 1, SLOTS).expand(1, KV_HEADS, SLOTS)
    keys = hf_rotate(torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g), INV_FREQ, SCALING, slots)
    values = torch.randn(1, KV_HEADS, SLOTS, DIM, generator=g)
    cache = FixedCache([keys], [values], slots, budget=6, prompt=8)
    q_positions = torch.arange(21, 31)
    queries = hf_rotate(torch.randn(1, HEADS, WINDOW, DIM, generator=g) + 0.5, INV_FREQ, SCALING, q_positions)
    recorded = Recorded(WINDOW)
    recorded.push_queries(0, queries, q_positions.unsqueeze(0), torch.ones(1, WINDOW, dtype=torch.bool))
    # Two evictions of this row: the previous one's newest token was at 22 (seen first, as the policy sees it).
    cache.next_position, cache.row_evictions = torch.tensor([23]), torch.tensor([0])
    policy.score(fixed_view(cache, policy, info, recorded=recorded))
    cache.next_position, cache.row_evictions = torch.tensor([31]), torch.tensor([1])
    got = policy.score(fixed_view(cache, policy, info, recorded=recorded))[0]
    counted = q_positions >= 27  # decoded since 22: 23..30, less the oldest 4
    expected = _reference(keys, values, queries, q_positions, 31, 16, policy.sinks, positions, counted=counted)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_an_unknown_query_span_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="query_span.*since-eviction, window"):
        reasonkv.get_policy("expected-attention", query_span="last")
