"""The eviction trace and the inspect page under an allocation: heads keep different numbers of tokens.

At every eviction of every row of a ragged batch the trace holds what each head of the cache holds, each
head's ranks are its own (1 to what it held, the kept ones first), its count follows the allocation's rule, and
the budget table in the trace is the evictor's; the trace reloads equal; the page carries each head's budget
and what it kept; the command takes the allocation and refuses what it cannot trace before decoding.
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
import torch

import reasonkv
from conftest import NoEosTokenizer, tiny_gemma3, tiny_llama
from reasonkv.cache import CacheSpec
from reasonkv.cache.allocation import adaptive_floor
from reasonkv.cache.decisions import Eviction, by_position
from reasonkv.cli import main
from reasonkv.inspect.page import page_data, render_page
from reasonkv.inspect.runs import Inspection, inspect_prompt
from reasonkv.inspect.trace import load_trace, save_trace

PROMPT = [5 + (7 * i) % 80 for i in range(40)]
PROMPTS = [PROMPT, PROMPT[5:29], PROMPT[11:]]  # a ragged batch: 40, 24 and 29 tokens
LAYERS, KV_HEADS, BUDGET, BUFFER = 4, 2, 16, 5
OPTIONS = {"snapkv": {"window": 3}}


def _budget_file(tmp_path) -> str:
    """A lopsided calibrated file: every (layer, head) its own weight."""
    weights = torch.rand(LAYERS, KV_HEADS, generator=torch.Generator().manual_seed(5)) + 0.05
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps({"layers": LAYERS, "kv_heads": KV_HEADS, "weights": weights.tolist()}))
    return str(path)


def _spec(policy: str, allocation: str, tmp_path, **extra) -> CacheSpec:
    budgets_file = _budget_file(tmp_path) if allocation == "calibrated" else None
    options = {**OPTIONS.get(policy, {}), **extra}
    return CacheSpec.build(
        policy, BUDGET, BUFFER, seed=[1, 2, 3], allocation=allocation, budgets_file=budgets_file, **options
    )


def _held(positions: torch.Tensor, seen: int) -> np.ndarray:
    """``[heads, S]`` positions of one row -> ``[heads, seen]`` bool."""
    mask = np.zeros((positions.shape[0], seen), dtype=bool)
    for h, row in enumerate(positions.tolist()):
        mask[h, [p for p in row if p >= 0]] = True
    return mask


def _check_eviction(last: Eviction, cache, row: int, spec: CacheSpec, table: np.ndarray) -> np.ndarray:
    """One row's newest eviction record against the cache right after it; returns what each head of the
    evicting layers kept."""
    recorder = cache.evictor.log
    assert last.seen == int(cache.next_position[row])
    kept, before = last.kept_mask(), last.before_mask()
    for t, layer in enumerate(recorder.layers):  # sliding-window layers too: their window
        assert np.array_equal(kept[t], _held(cache.positions(layer)[row], last.seen)), (row, layer)
    evicting = [t for t, kind in enumerate(recorder.kinds) if kind == "full"]
    counts, held, kept = last.kept_counts()[evicting], last.held_counts(), kept[evicting]
    in_cache = np.stack([cache.head_counts(layer)[row].cpu().numpy() for layer in cache.full_layers])
    assert np.array_equal(counts, in_cache)
    assert (kept <= before).all() and (held >= counts).all()
    layers, heads = held.shape
    if spec.allocation == "adaptive":  # one selection over each layer's heads, every head its floor first
        floor = adaptive_floor(spec.adaptive_alpha, spec.budget)
        assert np.array_equal(counts.sum(1), np.minimum(spec.budget * heads, held.sum(1)))
        assert (counts >= np.minimum(floor, held)).all()
    else:
        if spec.allocation == "pyramid":  # PyramidKV caps its schedule by what the row has seen and holds
            table = spec.budget_table(layers, heads, length=last.seen, held=int(held.max())).numpy()
        assert np.array_equal(counts, np.minimum(table, held))
    n = int(held.max())
    if last.ranks is not None:  # each head's own ranks 1..held, 0 after them; the kept ones are its best
        assert last.ranks.shape == (layers, heads, n)
        for e, h in np.ndindex(layers, heads):
            own = last.ranks[e, h, : held[e, h]]
            assert np.array_equal(np.sort(own), np.arange(1, held[e, h] + 1)), (row, e, h)
            assert (last.ranks[e, h, held[e, h] :] == 0).all()
            positions = np.flatnonzero(before[e, h])
            assert np.array_equal(kept[e, h, positions], own <= counts[e, h]), (row, e, h)
    if last.scores is not None:
        assert last.scores.shape == (layers, heads, n)
        for e, h in np.ndindex(layers, heads):
            assert np.isnan(last.scores[e, h, held[e, h] :]).all()
    for name, value in last.signals.items():  # per head under an allocation, a token policy's too
        if value.dtype != np.uint8:
            assert value.shape == (layers, heads, n), name
    return counts


def _decode_checking(spec: CacheSpec, max_new_tokens: int = 40, model=None):
    """A traced ragged batch, each row's new record checked against the cache after every forward."""
    model = model or tiny_llama(layers=LAYERS, kv_heads=KV_HEADS)
    checked, kept = [0] * len(PROMPTS), []

    def check(step, cache):
        recorder = cache.evictor.log
        table = cache.evictor.budgets.cpu().numpy()
        assert np.array_equal(recorder.trace(0).budgets, table)
        for row in range(len(PROMPTS)):
            evictions = recorder.by_row[row]
            if len(evictions) == checked[row]:
                continue
            assert len(evictions) == checked[row] + 1, "one eviction per forward at most"
            kept.append(_check_eviction(evictions[-1], cache, row, spec, table))
            checked[row] += 1

    kw = dict(max_new_tokens=max_new_tokens, chat=False, ignore_eos=True)
    results = reasonkv.generate(model, None, PROMPTS, spec=spec, trace=True, on_step=check, **kw)
    for row, result in enumerate(results):
        assert len(result.trace.evictions) == checked[row] == result.stats["evictions"] >= 5
    plain = reasonkv.generate(model, None, PROMPTS, spec=spec, **kw)
    assert [r.token_ids for r in plain] == [r.token_ids for r in results]  # recording changes nothing
    return results, kept


@pytest.mark.parametrize("allocation", ["pyramid", "adaptive", "calibrated"])
@pytest.mark.parametrize("policy", ["snapkv", "random", pytest.param("h2o", marks=pytest.mark.slow)])
def test_the_trace_of_a_ragged_batch_is_the_cache_at_every_eviction(policy, allocation, tmp_path, one_torch_thread):
    spec = _spec(policy, allocation, tmp_path)
    results, kept = _decode_checking(spec)
    trace = results[0].trace
    table = spec.budget_table(LAYERS, KV_HEADS).numpy()
    assert np.array_equal(trace.budgets, table) and int(trace.budgets.sum()) == BUDGET * LAYERS * KV_HEADS
    settings = trace.settings
    assert settings["allocation"] == allocation and settings["ragged_heads"] is True
    if allocation == "adaptive":
        assert settings["adaptive_floor"] == adaptive_floor(0.2, BUDGET) and (trace.budgets == BUDGET).all()
    if allocation == "calibrated":
        assert settings["budgets_file"] == spec.budgets_file
    # Heads really kept different numbers: layers (pyramid, calibrated), or heads at some eviction (adaptive:
    # snapkv's heads score apart; a token policy ranks alike in every head, so they split the layer evenly).
    if allocation != "adaptive":
        assert any(len(set(counts.flatten().tolist())) > 1 for counts in kept)
    elif policy == "snapkv":
        assert any((counts[:, 0] != counts[:, 1]).any() for counts in kept)


@pytest.mark.slow
@pytest.mark.parametrize("allocation", ["pyramid", "adaptive"])
def test_epikv_under_an_allocation_records_its_bands_per_head(allocation, tmp_path, one_torch_thread):
    """A token-granularity policy's score and bands reach every head at the positions it holds."""
    results, _ = _decode_checking(_spec("epikv", allocation, tmp_path))
    for eviction in results[0].trace.evictions:
        a, b = (eviction.signal(name).astype(np.float32) for name in ("band_a", "band_b"))
        score, held = eviction.scores.astype(np.float32), eviction.held_counts()
        for e, h in np.ndindex(*held.shape):
            n = held[e, h]
            difference = a[e, h, :n] - b[e, h, :n]
            tolerance = 1e-3 * (np.abs(a[e, h, :n]) + np.abs(b[e, h, :n]) + np.abs(score[e, h, :n])) + 1e-6
            assert (np.abs(difference - score[e, h, :n]) <= tolerance).all()


def test_padded_heads_trace_the_same_tokens_as_ragged_storage(tmp_path, one_torch_thread):
    spec = _spec("snapkv", "pyramid", tmp_path)
    ragged, _ = _decode_checking(spec, max_new_tokens=30)
    padded, _ = _decode_checking(spec.replace(ragged=False), max_new_tokens=30)
    assert padded[0].trace.settings["ragged_heads"] is False
    for a, b in zip(ragged[1].trace.evictions, padded[1].trace.evictions, strict=True):
        assert np.array_equal(a.kept, b.kept) and np.array_equal(a.ranks, b.ranks)


def test_a_trace_under_an_allocation_reloads_equal(tmp_path, one_torch_thread):
    [result, *_] = reasonkv.generate(
        tiny_llama(layers=LAYERS, kv_heads=KV_HEADS),
        None,
        PROMPTS,
        spec=_spec("snapkv", "adaptive", tmp_path),
        max_new_tokens=30,
        chat=False,
        ignore_eos=True,
        trace=True,
    )
    path = tmp_path / "trace.npz"
    save_trace(path, {"snapkv~adaptive": {"trace": result.trace, "token_ids": result.token_ids}})
    loaded = load_trace(path)["snapkv~adaptive"]["trace"]
    assert loaded.settings == result.trace.settings and np.array_equal(loaded.budgets, result.trace.budgets)
    assert len(loaded.evictions) == len(result.trace.evictions) >= 5
    for a, b in zip(loaded.evictions, result.trace.evictions, strict=True):
        assert a.seen == b.seen and np.array_equal(a.kept_counts(), b.kept_counts())
        for key in ("kept", "before", "protected", "ranks"):
            assert np.array_equal(getattr(a, key), getattr(b, key)), key
        assert np.array_equal(a.scores, b.scores, equal_nan=True)
    assert any(np.isnan(e.scores).any() for e in loaded.evictions)  # heads that held fewer: padded values


def test_uniform_traces_keep_their_settings_and_layout(one_torch_thread):
    """Without an allocation: no allocation keys, every head's values as many (no padding), a token policy's
    signals one row."""
    kw = dict(budget=12, buffer=4, max_new_tokens=28, seed=3)
    [result] = reasonkv.generate(tiny_llama(), NoEosTokenizer(), "A prompt.", policy="epikv", trace=True, **kw)
    trace = result.trace
    assert trace.budgets is None and not {"allocation", "budgets"} & set(trace.settings)
    for eviction in trace.evictions:
        held = eviction.held_counts()
        assert (held == held[0, 0]).all() and eviction.scores.shape[-1] == held[0, 0]
        assert not np.isnan(eviction.scores).any() and eviction.signal("band_a").shape == (held[0, 0],)
    assert "counts" not in page_data(Inspection("m", []))  # nothing to show: no runs


def test_by_position_spreads_token_values_over_each_heads_slots():
    values = torch.tensor([[10.0, 11.0, 12.0, 13.0]])
    positions = torch.tensor([[-1, 2, 5, 7]])
    heads = torch.tensor([[[[-1, -1, 5, 7], [2, 5, 7, 9]]]])  # one layer, two heads; 9 is not among them
    out = by_position(values, positions, heads)
    assert torch.equal(out.isnan(), torch.tensor([[[[True, True, False, False], [False, False, False, True]]]]))
    assert out[0, 0, 0, 2:].tolist() == [12.0, 13.0] and out[0, 0, 1, :3].tolist() == [11.0, 12.0, 13.0]
    assert by_position(values, positions, heads, fill=-1.0)[0, 0, 1, 3] == -1.0
    mask = by_position(torch.tensor([[True, False, True, True]]), positions, heads)
    assert mask.tolist() == [[[[False, False, True, True], [False, True, True, False]]]]


def _embedded(page: str) -> dict:
    return json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))


def test_the_page_carries_each_heads_budget_and_what_it_kept(tmp_path, one_torch_thread):
    specs = [
        CacheSpec.build("h2o", BUDGET, BUFFER, allocation="pyramid"),
        CacheSpec.build("snapkv", BUDGET, BUFFER, window=3, allocation="adaptive"),
        CacheSpec.build("random", BUDGET, BUFFER),  # uniform beside them
    ]
    model = tiny_llama(layers=LAYERS, kv_heads=KV_HEADS)
    inspection = inspect_prompt(model, NoEosTokenizer(), PROMPT, specs, max_new_tokens=40)
    page = render_page(inspection)
    data = _embedded(page)
    for run, shown in zip(inspection.runs, data["runs"], strict=True):
        trace = run.trace
        if run.name in ("full", "random"):
            assert "budgets" not in shown["settings"] and all("counts" not in e for e in shown["evictions"])
            continue
        assert shown["settings"]["budgets"] == trace.budgets.tolist() == trace.settings["budgets"]
        assert len(shown["evictions"]) == len(trace.evictions) >= 5
        for eviction, raw in zip(trace.evictions, shown["evictions"], strict=True):
            assert raw["counts"] == eviction.kept_counts()[list(trace.evicting)].tolist()
            scores = np.frombuffer(base64.b64decode(raw["scores"]), "<f2")
            assert np.array_equal(scores, eviction.scores.ravel(), equal_nan=True)
    pyramid = [row[0] for row in data["runs"][1]["settings"]["budgets"]]  # falling with depth
    assert pyramid == sorted(pyramid, reverse=True) and pyramid[0] > pyramid[-1]
    assert "renderBudgets" in page and 'class: "budgets"' in page


def test_the_command_traces_under_an_allocation(tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.setattr(
        "reasonkv.cli.inspect.load_model_from", lambda args: (tiny_llama(layers=LAYERS), NoEosTokenizer())
    )
    out, trace = tmp_path / "a.html", tmp_path / "a.npz"
    args = ["inspect", "--prompt", "What is two plus two? Think.", "--policies", "h2o,snapkv", "--budget", "12"]
    args += ["--buffer", "4", "-o", "snapkv.window=3", "--allocation", "adaptive", "--adaptive-alpha", "0.5"]
    assert main([*args, "--max-new-tokens", "30", "--out", str(out), "--save-trace", str(trace)]) == 0
    data = _embedded(out.read_text())
    for run in data["runs"][1:]:
        settings = run["settings"]
        assert settings["allocation"] == "adaptive" and settings["adaptive_alpha"] == 0.5
        assert settings["adaptive_floor"] == 6 and len(settings["budgets"]) == LAYERS
        assert len(run["evictions"]) >= 2
        assert all(sum(map(sum, e["counts"])) == 12 * LAYERS * 2 for e in run["evictions"])
    again = tmp_path / "b.html"
    assert main(["inspect", "--trace", str(trace), "--out", str(again)]) == 0
    assert again.read_text() == out.read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policies", "h2o,quest", "--allocation", "pyramid"], "not to 'quest' (it selects"),
        (["--allocation", "calibrated"], "budgets"),
        (["--allocation", "adaptive", "--adaptive-alpha", "2"], "adaptive_alpha must be a number in [0, 1]"),
    ],
)
def test_what_cannot_be_traced_is_refused_before_the_model_loads(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("reasonkv.cli.inspect.load_model_from", lambda args: pytest.fail("the model was loaded"))
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "--prompt", "x", "--budget", "64", "--out", "page.html", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("allocation", ["pyramid", "adaptive"])
@pytest.mark.parametrize("policy", ["snapkv", pytest.param("streaming", marks=pytest.mark.slow)])
def test_a_hybrid_models_trace_under_an_allocation(policy, allocation, tmp_path, one_torch_thread):
    """Gemma 3: the sliding-window layers traced with their window, the budgets over the full-attention ones."""
    spec = CacheSpec.build(policy, 12, 5, seed=[1, 2, 3], allocation=allocation, **OPTIONS.get(policy, {}))
    results, kept = _decode_checking(spec, model=tiny_gemma3())
    trace = results[0].trace
    assert trace.kinds == ("sliding", "full", "sliding", "full") and trace.budgets.shape == (2, kept[0].shape[1])
    assert int(trace.budgets.sum()) == 12 * trace.budgets.size


def test_a_model_the_allocation_cannot_hold_is_refused_before_decoding(tmp_path, monkeypatch, capsys):
    model = tiny_llama(layers=2)
    model.config._attn_implementation = "flash_attention_2"
    monkeypatch.setattr("reasonkv.cli.inspect.load_model_from", lambda args: (model, NoEosTokenizer()))
    monkeypatch.setattr("reasonkv.inspect.runs.generate", lambda *a, **k: pytest.fail("decoded"))
    args = ["inspect", "--prompt", "x", "--policies", "h2o", "--budget", "12", "--allocation", "pyramid"]
    assert main([*args, "--out", str(tmp_path / "p.html")]) == 2
    assert "through the sdpa or eager attention kernel" in capsys.readouterr().err


def test_eval_keeps_the_traces_of_each_allocation(tmp_path, one_torch_thread):
    """``eval --allocations ... --trace-problems``: each allocation's generation keeps its trace, which names the
    allocation and its budgets and opens as a page."""
    from reasonkv.eval.runner import run_grid

    dataset = tmp_path / "problems.jsonl"
    problems = [{"id": "p1", "problem": "What is 2+2?", "answer": "4"}, {"id": "p2", "problem": "Half?", "answer": "5"}]
    dataset.write_text("".join(json.dumps(p) + "\n" for p in problems), encoding="utf-8")
    grid = dict(policies="full,h2o", budgets=[10], buffer=4, max_new_tokens=24, batch_size=2, progress=False)
    out = tmp_path / "runs.jsonl"
    run_grid(
        tiny_llama(layers=LAYERS),
        NoEosTokenizer(),
        dataset=str(dataset),
        out=str(out),
        trace_problems="p2",
        allocations="uniform,pyramid,adaptive",
        **grid,
    )
    files = {path.name: path for path in (tmp_path / "runs.traces").iterdir()}
    runs = {run.name: (run, path) for path in files.values() for run in Inspection.load(path).runs}
    assert set(runs) == {"full", "h2o@10", "h2o~pyramid@10", "h2o~adaptive@10"}, sorted(files)
    assert runs["h2o@10"][0].trace.budgets is None
    for allocation in ("pyramid", "adaptive"):
        run, path = runs[f"h2o~{allocation}@10"]
        trace = run.trace
        assert trace.settings["allocation"] == allocation and int(trace.budgets.sum()) == 10 * LAYERS * 2
        assert len(trace.evictions) >= 2
        page = tmp_path / f"{allocation}.html"
        assert main(["inspect", "--trace", str(path), "--out", str(page)]) == 0
        assert _embedded(page.read_text())["runs"][0]["settings"]["budgets"] == trace.budgets.tolist()
