"""``reasonkv bench --quantized Q --bits b``: tiered variants beside the plain policies, at the same K/V bytes."""

from __future__ import annotations

import json
import math

import pytest

from reasonkv.cli import main

TINY = ["bench", "--model", "shape:tiny", "--dtype", "fp32", "--no-progress", "--no-plots", "--rounds", "1"]
PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny: 4 layers x (K, V) x 2 kv heads x head_dim 32 x fp32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_tiered_variant_runs_beside_its_plain_policy_at_the_same_measured_kv_bytes(tmp_path, capsys):
    out = tmp_path / "tier"
    args = [*TINY, "--policies", "streaming", "--lengths", "160", "--budget", "48", "--buffer", "16"]
    args += ["--prompt-length", "16", "--quantized", "32", "--bits", "4", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Quantized tier against the plain policy" in printed
    document = json.loads((out / "bench.json").read_text(), parse_constant=pytest.fail)
    assert "--quantized 32 --bits 4" in document["command"]
    records = {r["policy"]: r for r in document["records"]}
    assert set(records) == {"full", "streaming", "streaming+int4:32"}
    # int4, groups of 32: 32 bytes of codes, 8 + 8 of statistics, a 2-byte group id = 50 bytes a token, against
    # 256 at full precision: nominally 32 of them take the bytes of 6.25 full tokens, so K' = 48 - 7. Measured,
    # the tier also holds its pending tokens at full precision: K' is lower.
    tier = records["streaming+int4:32"]["tier"]
    assert (tier["policy"], tier["quantized"], tier["bits"], tier["group_size"]) == ("streaming", 32, 4, 32)
    assert tier["nominal_budget"] == 41 and tier["budget"] < 41
    assert tier["budget"] == 48 - math.ceil(tier["calibration"]["tier_bytes"] / PER_TOKEN)
    [tiered] = [w for w in records["streaming+int4:32"]["windows"] if w["length"] == 160]
    [plain] = [w for w in records["streaming"]["windows"] if w["length"] == 160]
    assert plain["kv_bytes"] == (48 + 16) * PER_TOKEN
    # Equal measured bytes: the tiered cache holds the plain one's K/V bytes, to within one token's.
    assert tiered["kv_bytes"] == (tier["budget"] + 16) * PER_TOKEN + tiered["kv_bytes_quantized"]
    assert abs(tiered["kv_bytes"] - plain["kv_bytes"]) < PER_TOKEN
    summary = document["summary"]["tiers"]["1"]["streaming+int4:32"]
    assert summary["plain_budget"] == 48 and summary["budget"] == tier["budget"]
    assert summary["nominal_budget"] == 41
    assert summary["kv_bytes_vs_plain"]["160"] == pytest.approx(tiered["kv_bytes"] / plain["kv_bytes"])
    assert summary["step_vs_plain"]["160"] == pytest.approx(tiered["step_mean_s"] / plain["step_mean_s"])
    assert f"| streaming+int4:32 | {tier['budget']} (41) + 32 int4 (vs 48) | 160 |" in (out / "bench.md").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--bits", "4"], "bits=4 has no effect without a quantized tier"),
        (["--quantized", "8", "--policies", "full"], "--quantized needs at least one evicting policy"),
        (["--quantized", "600", "--policies", "streaming"], "600 int8 tokens take the K/V bytes of"),
        (["--quantized", "16", "--policies", "streaming"], "quantized=16 holds fewer tokens than one key group"),
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
