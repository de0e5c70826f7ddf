"""The eval grid with a quantized tier: its cells, its records, resuming, fidelity-only runs."""

from __future__ import annotations

import json

import pytest

from conftest import NoEosTokenizer, tiny_llama
from reasonkv.eval.grid import make_cells
from reasonkv.eval.runner import run_grid
from reasonkv.runs.store import read_records as read_all

PROBLEMS = [
    {"id": "p1", "problem": "What is 2+2?", "answer": "4", "solution": "2+2 = <<2+2=4>>4.\n#### 4"},
    {"id": "p2", "problem": "Half of 10?", "answer": "5", "solution": "Half of ten is \\boxed{5}."},
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return str(path)


def _grid(dataset: str, out, **overrides) -> dict:
    kwargs = dict(
        dataset=dataset,
        out=str(out),
        policies="full,streaming",
        budgets=[10],
        buffer=4,
        max_new_tokens=20,
        batch_size=4,
        progress=False,
        fidelity=True,
    )
    kwargs.update(overrides)
    return kwargs


def test_tiered_cells_are_labelled_and_refuse_what_cannot_work():
    [full, tiered] = make_cells(["full", "snapkv"], [16], 4, ["snapkv.window=4"], quantized=12, bits=4)
    assert full.quantized == 0 and full.label == "full"  # the reference runs without a tier
    assert tiered.label == "snapkv[window=4]+int4:12" and tiered.name == "snapkv[window=4]+int4:12@16"
    assert tiered.spec.tier == {"quantized": 12, "bits": 4, "group_size": None}
    assert make_cells(["streaming"], [16], 4, quantized=8)[0].bits == 8  # int8 by default
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 2"):
        make_cells(["streaming"], [16], 4, quantized=8, bits=2)
    with pytest.raises(ValueError, match="bits=4 has no effect without a quantized tier"):
        make_cells(["streaming"], [16], 4, bits=4)
    with pytest.raises(ValueError, match="quantized must be a non-negative integer .*got -1"):
        make_cells(["streaming"], [16], 4, quantized=-1)
    with pytest.raises(ValueError, match=r"36 protected tokens exceed the budget K \+ Q = 16 \+ 8 = 24"):
        make_cells(["snapkv"], [16], 4, quantized=8)


def read_records(path):
    """The result records (each run also writes its manifest)."""
    return [r for r in read_all(path) if r["kind"] != "manifest"]


def test_a_tier_gets_its_own_records_beside_the_plain_ones_and_resumes(dataset, tmp_path):
    out = tmp_path / "results.jsonl"
    model, tokenizer = tiny_llama(), NoEosTokenizer()
    plain = run_grid(model, tokenizer, **_grid(dataset, out))
    tiered = run_grid(model, tokenizer, **_grid(dataset, out, quantized=16, bits=4))
    assert tiered.generated == 2 and tiered.fidelity == 2  # full (2 generation records) was already there
    records = read_records(out)
    assert len(records) == plain.generated + plain.fidelity + 4
    mine = [r for r in records if r.get("tier")]
    assert {r["policy_label"] for r in mine} == {"streaming+int4:16"} and len(mine) == 4
    per_token = 3 * 2 * 2 * 16 * 4  # layers x (K and V) x kv_heads x head_dim x fp32
    for record in mine:
        assert record["tier"] == {"quantized": 16, "bits": 4, "group_size": 16}  # head_dim 16
        assert record["budget"] == 10
        # 16 int4 tokens (codes 16 + statistics 8 + 8 + id 2 = 34 bytes) beside 10 fp32 ones (128 bytes)
        assert record["equivalent_budget"] == pytest.approx(10 + 16 * 34 / 128, abs=0.01)
        # Measured: K full-precision tokens, and the tier's real bytes (its pending tokens at full precision)
        held = record["steady_kv_bytes_by_tier"]
        assert held["full"] == 10 * per_token and held["quantized"] > 0
        assert record["steady_kv_tokens"] == pytest.approx((held["full"] + held["quantized"]) / per_token, abs=1e-3)
    generation = [r for r in mine if r["kind"] == "generation"]
    assert all(r["evictions"] > 0 and r["peak_kv_bytes_by_tier"]["quantized"] > 0 for r in generation)
    assert all(r["peak_row_tokens"] == max(r["prompt_tokens"], 10 + 4 + 16) for r in generation)
    assert all(r["tier"] is None for r in records if r["policy"] == "full" or r not in mine)
    plain_fidelity = [r for r in records if r["kind"] == "fidelity" and not r.get("tier")]
    assert all(r["steady_kv_bytes_by_tier"] == {"full": 10 * per_token, "quantized": 0} for r in plain_fidelity)
    assert all(r["steady_kv_tokens"] == 10 for r in plain_fidelity)
    # Each decode step of the replay held between K and K + B + 1 tokens, and read all it held
    for r in [r for r in records if r["kind"] == "fidelity"]:
        assert r["kv_bytes_read_per_step"] == r["kv_bytes_held_per_step"]
    for r in plain_fidelity:
        assert 10 * per_token < r["kv_bytes_held_per_step"] <= (10 + 4 + 1) * per_token
    again = run_grid(model, tokenizer, **_grid(dataset, out, quantized=16, bits=4))
    assert again.generated == again.fidelity == 0 and again.skipped == len(mine) + 2


def test_fidelity_only_writes_no_generation_records_for_evicting_cells(dataset, tmp_path):
    out = tmp_path / "results.jsonl"
    result = run_grid(tiny_llama(), NoEosTokenizer(), **_grid(dataset, out, quantized=16, generation=False))
    records = read_records(out)
    kinds = sorted((r["kind"], r["policy"]) for r in records)
    assert kinds == [("fidelity", "streaming")] * 2 + [("generation", "full")] * 2
    assert all(r["trace_source"] == "generation" for r in records if r["kind"] == "fidelity")
    assert result.fidelity == 2
    with pytest.raises(ValueError, match="fidelity-only .* with fidelity off would measure nothing"):
        run_grid(tiny_llama(), NoEosTokenizer(), **_grid(dataset, out, generation=False, fidelity=False))


def _fidelity(policy, budget, measured, top1, kl, tier=None, dataset="gsm8k", nominal=None):
    return {
        "kind": "fidelity",
        "dataset": dataset,
        "policy": policy,
        "budget": budget,
        "tier": tier,
        "equivalent_budget": budget if nominal is None else nominal,
        "steady_kv_tokens": measured,
        "top1_agreement": top1,
        "kl_mean": kl,
    }


def test_equal_bytes_report_groups_cells_by_their_measured_bytes(tmp_path):
    from reasonkv.cli import equal_bytes as equal_bytes_command
    from reasonkv.eval import equal_bytes

    int8 = {"quantized": 90, "bits": 8, "group_size": 32}
    records = [
        _fidelity("h2o", 128, 128, 0.90, 0.10),
        _fidelity("h2o", 128, 128, 0.80, 0.30),
        _fidelity("h2o", 64, 127.5, 0.95, 0.05, int8, nominal=115.4),
        _fidelity("h2o", 64, 128.3, float("nan"), 0.07, int8, nominal=115.4),  # NaN metrics: left out of the mean
        _fidelity("h2o", 64, 140.0, 0.99, 0.01, {**int8, "quantized": 112}, nominal=127.9),  # more bytes: its own
        {"kind": "fidelity", "policy": "h2o", "budget": 128, "dataset": "gsm8k", "equivalent_budget": 128},  # older
        {"kind": "generation", "policy": "h2o", "budget": 128, "dataset": "gsm8k", "steady_kv_tokens": 128},
    ]
    table = equal_bytes.cells(records)
    got = [(c.variant, c.bytes_budget, c.quantized, c.problems) for c in table]
    assert got == [("full precision", 128, 0, 2), ("int8", 128, 90, 2), ("int8", 140, 112, 1)]
    assert table[0].top1 == pytest.approx(0.85) and table[1].top1 == pytest.approx(0.95)
    assert table[1].kl == pytest.approx(0.06) and table[1].measured == pytest.approx(127.9)
    assert table[1].nominal == pytest.approx(115.4)
    text = equal_bytes.markdown(table)
    rows = [line for line in text.splitlines() if line.startswith("| h2o")]
    assert rows == [  # by measured bytes: the tier of 127.9 beside the plain cell of 128
        "| h2o | int8 | 64 + 90 | 127.9 | 115.4 | 0.950 | 0.060 | 2 |",
        "| h2o | full precision | 128 | 128.0 | 128.0 | 0.850 | 0.200 | 2 |",
        "| h2o | int8 | 64 + 112 | 140.0 | 127.9 | 0.990 | 0.010 | 1 |",
    ]
    results = tmp_path / "results.jsonl"
    lines = [json.dumps({**r, "problem_id": f"p{i}"}) + "\n" for i, r in enumerate(records[:4])]
    results.write_text("".join(lines), encoding="utf-8")
    assert equal_bytes_command.main([str(results), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "equal-bytes-gsm8k.png").read_bytes()[:4] == b"\x89PNG"
    assert "| h2o | int8 |" in (tmp_path / "report" / "equal-bytes.md").read_text()


def test_tier_sizes_solve_for_the_q_whose_measured_bytes_fill_a_budget(tmp_path, capsys):
    from reasonkv.cli import equal_bytes as equal_bytes_command
    from reasonkv.eval import equal_bytes

    def tier(q):
        return {"quantized": q, "bits": 4, "group_size": 32}

    # Measured: 16 + 8 (the pending tokens) + Q / 5 tokens, on two problems each.
    records = [_fidelity("snapkv", 16, 16 + 8 + q / 5 + d, 0.9, 0.1, tier(q)) for q in (40, 80) for d in (-0.5, 0.5)]
    records.append(_fidelity("snapkv", 32, 32, 0.8, 0.2))  # plain: not sized
    [size] = equal_bytes.tier_sizes(records, 32)
    assert (size["policy"], size["bits"], size["budget"], size["quantized"]) == ("snapkv", 4, 16, 40)
    assert equal_bytes.tier_sizes(records, 33.1)[0]["quantized"] == 45  # 45.5, rounded down: within the bytes
    results = tmp_path / "calibration.jsonl"
    results.write_text("".join(json.dumps({**r, "problem_id": f"p{i}"}) + "\n" for i, r in enumerate(records)))
    assert equal_bytes_command.main([str(results), "--size-for", "32"]) == 0
    assert capsys.readouterr().out == "snapkv 4 16 40\n"
