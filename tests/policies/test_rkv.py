"""R-KV: importance against eager attention rows, redundancy against a direct cosine-similarity loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import reasonkv
from conftest import tiny_llama
from reasonkv.hf import cache_keyword
from reasonkv.policies import select
from reasonkv.policies.rkv import RKV, key_redundancy, window_importance
from reasonkv.policies.view import EvictionView

TOKENS = [5 + (7 * i + i * i) % 83 for i in range(40)]


def _prefilled(model, policy, tokens=TOKENS, decoded=0):
    """A cache holding ``tokens`` (no eviction yet): a prefill, then the last ``decoded`` one at a time."""
    cache = reasonkv.EvictingCache(1000, 8, model=model, policy=policy)
    split = len(tokens) - decoded
    with torch.no_grad():
        for chunk in [tokens[:split]] + [[t] for t in tokens[split:]]:
            model(input_ids=torch.tensor([chunk]), use_cache=True, **{cache_keyword(model): cache})
    cache.detach()
    return cache


def _view(cache, layer, budget=None):
    ev = cache.evictor
    view = EvictionView(
        cache=cache,
        recorded=ev.observer.recorded,
        policy=ev.policy,
        rows=torch.arange(1),
        row_seeds=ev.row_seeds,
        info=ev.info,
        layer=layer,
    )
    if budget is not None:
        view.budget = budget
    return view


def _eager_rows(model, tokens=TOKENS):
    """Eager attention probabilities of every layer, ``[layers][heads, T, T]`` (the reference only)."""
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), use_cache=False, output_attentions=True)
    finally:
        model.config._attn_implementation = "sdpa"
    return [a[0].double() for a in out.attentions]


def _reference_importance(rows, kv_heads, pooling, query_window, window, kernel):
    """R-KV importance from eager rows: merge the group's logits, softmax over the keys before the
    window, mean over the window queries, max-pool. Logits = log p + a per-row constant, which
    cancels in the softmax (exact for mean pooling and for one query head per group)."""
    heads, t, _ = rows.shape
    n = t - window  # keys outside the window
    logp = rows[:, t - query_window :, :n].log().view(kv_heads, heads // kv_heads, query_window, n)
    merged = logp.amax(1) if pooling == "max" else logp.mean(1)
    attention = merged.softmax(-1).mean(1)  # [kv_heads, n]
    return F.max_pool1d(attention.unsqueeze(0), kernel, stride=1, padding=kernel // 2)[0]


@pytest.mark.parametrize(
    "kv_heads, pooling, window, decoded",
    [(4, "max", 8, 0), (4, "max", 8, 5), (2, "mean", 8, 12), (2, "mean", 4, 0), (1, "mean", 8, 3)],
    ids=["mha-max", "mha-max-decoded", "gqa-mean-decoded", "gqa-mean-short-window", "mqa-mean"],
)
def test_importance_equals_eager_window_rows(kv_heads, pooling, window, decoded):
    model = tiny_llama(kv_heads=kv_heads)
    policy = RKV(pooling=pooling, window=window)
    cache = _prefilled(model, policy, decoded=decoded)  # queries recorded by prefill and decode steps
    eager = _eager_rows(model)
    t = len(TOKENS)
    for layer in range(model.config.num_hidden_layers):
        got = policy.importance(_view(cache, layer))[0].double()
        want = _reference_importance(eager[layer], kv_heads, pooling, 8, window, 7)
        torch.testing.assert_close(got[:, : t - window], want, atol=1e-5, rtol=1e-4)
        assert torch.all(got[:, t - window :] == 0)  # the window is not scored


def test_gqa_max_pooling_equals_a_loop_over_the_recorded_queries():
    model = tiny_llama(kv_heads=2)
    policy = RKV()
    cache = _prefilled(model, policy)
    view = _view(cache, 1)
    queries, positions, _ = view.recent_queries()
    keys = view.keys()[0].double()
    scaling = view.recorded.scalings[1]
    t, w, g = len(TOKENS), 8, 2
    n = t - 8
    want = torch.zeros(2, n, dtype=torch.float64)
    for head in range(2):
        per_query = []
        for q in range(w):
            logits = [
                max(float(queries[0, head * g + j, q].double() @ keys[head, k]) * scaling for j in range(g))
                for k in range(n)
            ]
            peak = max(logits)
            weights = [math.exp(x - peak) for x in logits]
            per_query.append([x / sum(weights) for x in weights])
        want[head] = torch.tensor(per_query).mean(0)
    assert sorted(positions[0].tolist()) == list(range(t - w, t))
    want = F.max_pool1d(want.unsqueeze(0), 7, stride=1, padding=3)[0]
    torch.testing.assert_close(policy.importance(view)[0, :, :n].double(), want, atol=1e-6, rtol=1e-5)


def test_importance_averages_only_valid_queries_and_respects_causality():
    torch.manual_seed(4)
    queries, keys = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 12, 8)
    q_pos, key_pos = torch.tensor([[7, 8, 9, 10, 11]]), torch.arange(12).expand(1, 2, -1)
    q_valid = torch.tensor([[True, False, True, True, True]])
    candidates = torch.ones(1, 2, 12, dtype=torch.bool)
    got = window_importance(queries, q_pos, q_valid, keys, key_pos, candidates, 0.3, "mean")
    want = torch.zeros(1, 2, 12)
    for q in (0, 2, 3, 4):
        for head in range(2):
            logits = (queries[0, 2 * head : 2 * head + 2, q] @ keys[0, head].T).mean(0) * 0.3
            want[0, head, : int(q_pos[0, q]) + 1] += logits[: int(q_pos[0, q]) + 1].softmax(-1) / 4
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- redundancy


def _redundancy_loop(keys: torch.Tensor, threshold: float, retain: str) -> torch.Tensor:
    """Direct R-KV redundancy of one head, ``keys [n, d]``."""
    n = keys.shape[0]
    k = keys.double()
    sim = [[0.0 if i == j else float(k[i] @ k[j] / (k[i].norm() * k[j].norm())) for j in range(n)] for i in range(n)]
    for i in range(n):
        matches = [j for j in range(n) if j != i and sim[i][j] > threshold]
        if matches and retain != "none":
            sim[i][max(matches) if retain == "last" else min(matches)] = 0.0
    column = torch.tensor([sum(sim[i][j] for i in range(n)) / n for j in range(n)], dtype=torch.float64)
    return column.softmax(0)


def _planted_keys(rows=2, heads=2, slots=24, dim=8, seed=0):
    torch.manual_seed(seed)
    keys = torch.randn(rows, heads, slots, dim)
    keys[:, :, 11] = keys[:, :, 6] + 0.05 * torch.randn(rows, heads, dim)  # near-duplicates of token 6
    keys[:, :, 19] = keys[:, :, 6] + 0.05 * torch.randn(rows, heads, dim)
    return keys


@pytest.mark.parametrize("retain", ["last", "first", "none"])
def test_redundancy_equals_direct_loop_with_padding_and_chunks(retain):
    keys = _planted_keys()
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, :5] = False  # row 1: five padding slots holding garbage
    got = key_redundancy(keys, valid, threshold=0.5, retain=retain, chunk_elements=60)  # several row chunks
    for head in range(2):
        want0 = _redundancy_loop(keys[0, head], 0.5, retain)
        torch.testing.assert_close(got[0, head].double(), want0, atol=1e-6, rtol=1e-5)
        want1 = _redundancy_loop(keys[1, head, 5:], 0.5, retain)
        torch.testing.assert_close(got[1, head, 5:].double(), want1, atol=1e-6, rtol=1e-5)
    assert torch.all(got[1, :, :5] == 0)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 2))


@pytest.mark.parametrize("retain", ["last", "first"])
def test_redundancy_searched_in_small_blocks_equals_the_direct_loop(retain):
    """Several doubling blocks of keys (2, 4, 8, 16 of 30), rows resolving at different blocks."""
    keys = _planted_keys(slots=30)
    keys[:, :, 25] = keys[:, :, 2] + 0.05 * torch.randn(2, 2, 8)  # a duplicate far from its twin
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :3] = False
    got = key_redundancy(keys, valid, threshold=0.5, retain=retain, block=2, chunk_elements=50)
    for head in range(2):
        torch.testing.assert_close(
            got[0, head].double(), _redundancy_loop(keys[0, head], 0.5, retain), atol=1e-6, rtol=1e-5
        )
        torch.testing.assert_close(
            got[1, head, 3:].double(), _redundancy_loop(keys[1, head, 3:], 0.5, retain), atol=1e-6, rtol=1e-5
        )


@pytest.mark.parametrize("retain", ["last", "first"])
def test_heads_with_many_and_few_waiting_rows_search_in_tiles_like_the_direct_loop(retain, monkeypatch):
    """One head whose keys all match their neighbours (no row waits after the first block), one of unrelated
    keys (every row waits), one in between, searched in tiles of 3 rows: several tiles per head, padded ones."""
    import reasonkv.policies.rkv as rkv

    monkeypatch.setattr(rkv, "_TILE", 3)
    torch.manual_seed(5)
    slots, dim = 40, 16
    alike = torch.randn(1, dim) + 0.1 * torch.randn(slots, dim)  # every pair above the threshold
    unrelated = torch.randn(slots, dim)
    mixed = torch.randn(slots, dim)
    mixed[30:] = mixed[:10] + 0.05 * torch.randn(10, dim)  # ten rows with a far twin, the rest none
    keys = torch.stack([alike, unrelated, mixed]).unsqueeze(0)
    valid = torch.ones(1, slots, dtype=torch.bool)
    got = key_redundancy(keys, valid, threshold=0.5, retain=retain, block=4, chunk_elements=200)
    for head in range(3):
        want = _redundancy_loop(keys[0, head], 0.5, retain)
        torch.testing.assert_close(got[0, head].double(), want, atol=1e-6, rtol=1e-5)


def test_a_duplicate_window_only_searches_the_most_recent_keys():
    dim = 8
    base = torch.eye(dim)
    keys = torch.cat([base, base[2:3]]).view(1, 1, 9, dim)  # key 2 and its copy at slot 8, 6 slots apart
    valid = torch.ones(1, 9, dtype=torch.bool)
    exact = key_redundancy(keys, valid, retain="last")[0, 0]
    near = key_redundancy(keys, valid, retain="last", duplicate_window=4, block=2)[0, 0]
    far = key_redundancy(keys, valid, retain="last", duplicate_window=7, block=2)[0, 0]
    assert torch.equal(far, exact)  # slot 2 is within the 7 newest keys of slot 8's search
    assert near[2] > exact[2]  # slot 8's duplicate (slot 2) lies outside the 4 newest keys: no discount
    with pytest.raises(ValueError, match="duplicate_window must be None or a positive integer"):
        reasonkv.get_policy("rkv", duplicate_window=0)


def test_the_most_recent_of_near_duplicates_is_least_redundant():
    dim = 8
    base = torch.eye(dim)
    keys = base.clone()  # 8 orthogonal keys, then copies of key 2 at slots 8 and 9
    keys = torch.cat([keys, base[2:3], base[2:3]]).view(1, 1, 10, dim)
    valid = torch.ones(1, 10, dtype=torch.bool)
    last = key_redundancy(keys, valid, retain="last")[0, 0]
    assert last[9] < last[8] and last[9] < last[2]  # the newest copy survives
    first = key_redundancy(keys, valid, retain="first")[0, 0]
    assert first[2] < first[8] and first[2] < first[9]
    assert last[0] < last[2]  # unique tokens are less redundant than repeated ones


# --------------------------------------------------------------------------- the whole score


def test_score_and_kept_set_follow_the_formula():
    model = tiny_llama(kv_heads=4)
    policy = RKV()
    cache = _prefilled(model, policy)
    eager = _eager_rows(model)
    t, budget = len(TOKENS), 20
    for layer in (0, 2):
        view = _view(cache, layer, budget=budget)
        keys = view.keys()[0]
        importance = torch.zeros(4, t, dtype=torch.float64)
        importance[:, : t - 8] = _reference_importance(eager[layer], 4, "max", 8, 8, 7)
        redundancy = torch.stack([_redundancy_loop(keys[h], 0.5, "last") for h in range(4)])
        want = 0.1 * importance - 0.9 * redundancy
        torch.testing.assert_close(policy.score(view)[0].double(), want, atol=1e-5, rtol=1e-4)
        kept = policy.keep(view)[0]
        protected = select.protected_mask(
            torch.arange(t).expand(4, -1), sinks=4, window=8, newest=torch.tensor([t - 1]).expand(4)
        )
        for head in range(4):
            free = want[head].masked_fill(protected[head], float("-inf"))
            expected = set(torch.nonzero(protected[head]).flatten().tolist())
            expected |= set(free.topk(budget - len(expected)).indices.tolist())
            assert set(kept[head].tolist()) == expected


@pytest.mark.slow
def test_decoding_keeps_the_window_and_matches_the_oracle():
    from oracle import run_and_check

    model = tiny_llama(kv_heads=2)
    cache = run_and_check(model, "rkv", TOKENS, budget=24, buffer=6, steps=30, threshold=0.3, sinks=2)
    assert cache.evictions >= 4
    newest = len(TOKENS) + 30 - 1
    for layer in range(model.config.num_hidden_layers):
        for head in cache.positions(layer)[0].tolist():
            assert {0, 1} <= set(head)
            assert set(range(newest - (cache.slots - 24) - 7, newest + 1)) <= set(head)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mix_lambda": 1.5}, "mix_lambda must be in"),
        ({"mix_lambda": "0.1"}, "rkv: option mix_lambda='0.1': expected float"),
        ({"duplicate_window": 0}, "duplicate_window must be None or a positive integer, got 0"),
        ({"query_window": 0}, "query_window must be a positive integer"),
        ({"kernel": 0}, "kernel must be a positive integer"),
        ({"threshold": 2.0}, "threshold must be a cosine similarity"),
        ({"retain": "middle"}, "retain must be one of last, first, none"),
        ({"pooling": "sum"}, "pooling must be one of max, mean"),
        ({"window": -1}, "window must be a non-negative integer"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        reasonkv.get_policy("rkv", **options)


def test_defaults_and_description():
    policy = reasonkv.get_policy("rkv")
    assert (policy.mix_lambda, policy.query_window, policy.window, policy.kernel) == (0.1, 8, 8, 7)
    assert (policy.threshold, policy.retain, policy.pooling, policy.sinks) == (0.5, "last", "max", 4)
    assert RKV.granularity == "head" and "2505.24133" in RKV.paper
    assert policy.needs(None).query_window == 8 and not policy.needs(None).attention_last
