"""The bench report's K/V bytes held and read per decode step: selection policies beside evicting ones."""

from __future__ import annotations

import json

import pytest

from reasonkv.bench.reads import read_entry, reads_markdown
from reasonkv.cli import main

TINY = ["bench", "--model", "shape:tiny", "--dtype", "fp32", "--no-progress", "--rounds", "1", "--no-plots"]
PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny: 4 layers x (K, V) x 2 kv heads x head_dim 32 x fp32
PROMPT, TOP, BUDGET, BLOCK = 16, 128, 32, 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mean(values):
    return sum(values) / len(values)


def test_selection_reads_a_part_of_what_it_holds_evicting_policies_read_all(tmp_path, capsys):
    out = tmp_path / "reads"
    # every layer selecting (quest reads layers 0-1 whole by default, as its authors do), so each step's reads
    # have the bounds below
    args = [*TINY, "--policies", "quest,h2o", "-o", f"quest.block_size={BLOCK}", "-o", "quest.dense_layers=0"]
    args += ["--lengths", f"64,{TOP}"]
    args += ["--budget", str(BUDGET), "--buffer", "16", "--prompt-length", str(PROMPT), "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    document = json.loads((out / "bench.json").read_text(), parse_constant=pytest.fail)
    records = {r["policy"]: r for r in document["records"]}
    assert records["quest"]["selects"] is True and records["h2o"]["selects"] is False
    reads = document["summary"]["sweep"]["1"]["reads"]
    assert set(reads) == {"full", "streaming", "quest", "h2o"}

    quest = reads["quest"]
    fulls, reads_at = [], []
    for w in records["quest"]["windows"]:  # each window's steps read with every token so far held
        held = list(range(w["window_start"] + 1, w["length"] + 1))
        assert w["kv_bytes_full_read_per_step"] == pytest.approx(_mean(held) * PER_TOKEN)
        # each step reads at most budget tokens per head (the current block and budget // block - 1 more), and
        # at least the blocks before the current one once it holds more
        most = _mean([min(n, BUDGET) for n in held]) * PER_TOKEN
        least = _mean([min(n, BUDGET - BLOCK + 1) for n in held]) * PER_TOKEN
        assert least <= w["kv_bytes_read_per_step"] <= most
        fulls.append(w["kv_bytes_full_read_per_step"])
        reads_at.append(w["kv_bytes_read_per_step"])
    assert quest["kv_bytes_full_read_per_step"] == pytest.approx(_mean(fulls))
    assert quest["kv_bytes_read_per_step"] == pytest.approx(_mean(reads_at))
    assert quest["read_fraction"] == pytest.approx(_mean(reads_at) / _mean(fulls)) and quest["read_fraction"] < 1
    assert reads_at[-1] < 0.3 * fulls[-1]  # at 128 tokens: some 32 of 97 to 128 tokens read
    assert quest["kv_bytes_held_max"] == TOP * PER_TOKEN and quest["side_cache_bytes"] > 0
    # the run's own count (every decode step) agrees with the windows' at the longest length
    whole = records["quest"]["totals"]["selection"]
    assert whole["kv_bytes_full_read_per_step"] == pytest.approx(_mean(range(PROMPT + 1, TOP + 1)) * PER_TOKEN)

    for name in ("h2o", "streaming", "full"):  # read == held: the mean over the windows of what they held
        entry = reads[name]
        used = [w["kv_bytes_used"] for w in records[name]["windows"]]
        assert entry["kv_bytes_read_per_step"] == entry["kv_bytes_full_read_per_step"] == pytest.approx(_mean(used))
        assert entry["kv_bytes_held_max"] == max(used) and entry["read_fraction"] == 1.0
    assert reads["h2o"]["kv_bytes_held_max"] <= (BUDGET + 16) * PER_TOKEN < quest["kv_bytes_held_max"]

    text = (out / "bench.md").read_text()
    for where in (text, printed):
        assert "K/V bytes held and read per decode step" in where
        assert f"| quest | selects | {TOP * PER_TOKEN / 1024:.1f} KiB |" in where
        assert "| h2o | holds what it reads |" in where
    last = records["quest"]["windows"][-1]
    assert "| KV held | KV read per step | KV allocated |" in text
    assert f"| {TOP * PER_TOKEN / 2**20:.1f} MiB | {last['kv_bytes_read_per_step'] / 2**20:.1f} MiB |" in text


def test_a_selection_record_without_reading_counts_shows_no_reads():
    """A selection record whose windows carry no counts: its reads are unknown there, never taken as its held."""
    window = {"length": 64, "kv_bytes": 4096, "kv_bytes_used": 2048}
    entry = read_entry({"policy": "quest", "selects": True, "windows": [window], "totals": {}})
    assert entry["selects"] and entry["kv_bytes_held_max"] == 2048
    assert entry["kv_bytes_read_per_step"] is None and entry["read_fraction"] is None
    row = [line for line in reads_markdown({"quest": entry}, ["quest"]) if line.startswith("| quest")]
    assert row == ["| quest | selects | 2.0 KiB | - | - | - | - |"]
    # only evicting policies: no table (read == held says all)
    evicting = read_entry({"policy": "h2o", "windows": [window]})
    assert evicting["kv_bytes_read_per_step"] == 2048 and reads_markdown({"h2o": evicting}, ["h2o"]) == []


@pytest.mark.slow
def test_prefilled_batch_counts_reads_per_window_every_row_together(tmp_path):
    """A prefilled sweep (one cache per length, extended) of 2 rows: each window's reads, both rows together."""
    out = tmp_path / "prefilled"
    args = [*TINY, "--policies", "quest", "-o", f"quest.block_size={BLOCK}", "-o", "quest.dense_layers=0"]
    args += ["--lengths", "96,128", "--budget", str(BUDGET), "--buffer", "16", "--prefill-to-length"]
    args += ["--decode-steps", "16"]  # every layer selecting, so a step reads at most K per head
    assert main([*args, "--batch-sizes", "2", "--out", str(out)]) == 0
    document = json.loads((out / "bench.json").read_text())
    (quest,) = [r for r in document["records"] if r["policy"] == "quest"]
    assert quest["selects"] and [w["length"] for w in quest["windows"]] == [40, 96, 128]
    for w in quest["windows"]:
        held = list(range(w["window_start"] + 1, w["length"] + 1))
        assert w["kv_bytes_full_read_per_step"] == pytest.approx(2 * _mean(held) * PER_TOKEN)
        assert w["kv_bytes_read_per_step"] <= 2 * BUDGET * PER_TOKEN < w["kv_bytes_full_read_per_step"]
    reads = document["summary"]["sweep"]["2"]["reads"]["quest"]
    assert reads["read_fraction"] < 0.5 and reads["kv_bytes_held_max"] == 2 * 128 * PER_TOKEN
