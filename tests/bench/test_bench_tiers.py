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
    # int4, groups of 32: 32 bytes of codes, 8 + 8 of statistics, a 2-byte group id = 50 bytes a token, against
    # 256 at full precision: 16 of them take the bytes of 3.1 full tokens, so K' = 32 - 4.
    tier = records["streaming+int4:16"]["tier"]
    assert tier == {"policy": "streaming", "quantized": 16, "bits": 4, "group_size": 32, "budget": 28}
    [tiered] = [w for w in records["streaming+int4:16"]["windows"] if w["length"] == 96]
    [plain] = [w for w in records["streaming"]["windows"] if w["length"] == 96]
    assert plain["kv_bytes"] == (32 + 16) * PER_TOKEN
    # Held: per layer and kv head, 16 tokens of codes, value statistics and group ids (42 bytes each), and
    # one key group's statistics (2 x 32 channels x 4 bytes): streaming hands the tier 16 tokens per
    # eviction (B = 16) and drops them whole, so the group is half full and costs twice its nominal share.
    quantized = 4 * 2 * (16 * 42 + 2 * 32 * 4)
    assert tiered["kv_bytes"] == (28 + 16) * PER_TOKEN + quantized <= plain["kv_bytes"]
    summary = document["summary"]["tiers"]["1"]["streaming+int4:16"]
    assert summary["plain_budget"] == 32 and summary["budget"] == 28
    assert summary["kv_bytes_vs_plain"]["96"] == pytest.approx(tiered["kv_bytes"] / plain["kv_bytes"])
    assert summary["step_vs_plain"]["96"] > 0
    assert "| streaming+int4:16 | 28 + 16 int4 (vs 32) | 96 |" in (out / "bench.md").read_text()


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
