"""``reasonkv bench --quantized Q --bits b``: tiered variants beside the plain policies, at the same K/V bytes."""

from __future__ import annotations

import json

import pytest

from reasonkv.cli import main

TINY = ["bench", "--model", "shape:tiny", "--dtype", "fp32", "--no-progress", "--no-plots"]
PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny: 4 layers x (K, V) x 2 kv heads x head_dim 32 x fp32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_tiered_variant_runs_beside_its_plain_policy_at_the_same_kv_bytes(tmp_path, capsys):
    out = tmp_path / "tier"
    args = [*TINY, "--policies", "streaming", "--lengths", "96", "--budget", "32", "--buffer", "16"]
    args += ["--prompt-length", "16", "--quantized", "16", "--bits", "4", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Quantized tier against the plain policy" in printed
    document = json.loads((out / "bench.json").read_text(), parse_constant=pytest.fail)
    assert "--quantized 16 --bits 4" in document["command"]
    records = {r["policy"]: r for r in document["records"]}
    assert set(records) == {"full", "streaming", "streaming+int4:16"}
    # The README's nominal bytes of a quantized token per (layer, kv-head): 2 d x bits/8 + d/4 + 2 (codes, the
    # value statistics, the key-group id) plus a full key group's share of its statistics, against 4 d at fp32:
    # 42 + 8 = 50 bytes against 256 at head_dim 32, so 16 of them take the bytes of 3.1 full tokens: K' = 32 - 4.
    nominal = 2 * 32 * 4 // 8 + 32 // 4 + 2
    assert nominal == 42 and 16 * (nominal + 8) / 256 == pytest.approx(3.125)
    tier = records["streaming+int4:16"]["tier"]
    assert tier == {"policy": "streaming", "quantized": 16, "bits": 4, "group_size": 32, "budget": 28}
    [tiered] = [w for w in records["streaming+int4:16"]["windows"] if w["length"] == 96]
    [plain] = [w for w in records["streaming"]["windows"] if w["length"] == 96]
    assert plain["kv_bytes"] == (32 + 16) * PER_TOKEN
    # Held: per layer and kv head, 16 tokens of codes, value statistics and group ids (42 bytes each), and
    # one key group's statistics (2 x 32 channels x 4 bytes): streaming hands the tier 16 tokens per
    # eviction (B = 16) and drops them whole, so the group is half full and costs twice its nominal share.
    quantized = 4 * 2 * (16 * nominal + 2 * 32 * 4)
    assert tiered["kv_bytes"] == (28 + 16) * PER_TOKEN + quantized <= plain["kv_bytes"]
    summary = document["summary"]["tiers"]["1"]["streaming+int4:16"]
    assert summary["plain_budget"] == 32 and summary["budget"] == 28
    assert summary["kv_bytes_vs_plain"]["96"] == pytest.approx(tiered["kv_bytes"] / plain["kv_bytes"])
    # "step vs plain" is the tiered step over the plain one at the same length, as measured and as printed
    step = tiered["step_mean_s"] / plain["step_mean_s"]
    assert summary["step_vs_plain"]["96"] == pytest.approx(step)
    kv = tiered["kv_bytes"] / plain["kv_bytes"]
    assert summary["kv_bytes_vs_plain"]["96"] == pytest.approx(kv) and kv <= 1.0
    assert f"| streaming+int4:16 | 28 + 16 int4 (vs 32) | 96 | {step:.3f} |" in (out / "bench.md").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--bits", "4"], "bits=4 has no effect without a quantized tier"),
        (["--quantized", "8", "--policies", "full"], "--quantized needs at least one evicting policy"),
        (["--quantized", "600", "--policies", "streaming"], "600 int8 tokens take the K/V bytes of"),
    ],
)
def test_tier_arguments_are_checked(tmp_path, capsys, extra, message):
    args = [*TINY, "--lengths", "96", "--budget", "32", "--buffer", "16", "--prompt-length", "16"]
    if "--policies" not in extra:
        args += ["--policies", "streaming"]
    status = main([*args, *extra, "--out", str(tmp_path / "x")])
    captured = capsys.readouterr()
    assert message in captured.err + captured.out
    assert status != 0
