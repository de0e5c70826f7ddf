"""``reasonkv inspect``: the page is one self-contained file whose data is the trace's, the command decodes or
reads a saved trace, the figure is written, and the page of the demo's shape stays under its size limit."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from conftest import NoEosTokenizer, tiny_llama
from reasonkv.cache.spec import CacheSpec
from reasonkv.cli import main
from reasonkv.inspect.page import departure, page_data, render_page, write_page
from reasonkv.inspect.runs import Inspection, Run, inspect_prompt
from reasonkv.inspect.trace import Eviction, Trace

PROMPT = "What is two plus two? Think."
# The page of the bundled model's demo (30 layers, 3 kv-heads, a ~90-token prompt and 512 new tokens at
# K=128, B=32: 14 evictions) under full + 3 policies must stay below this.
PAGE_LIMIT_BYTES = 8 * 2**20


def small_inspection(max_new_tokens: int = 40) -> Inspection:
    specs = [CacheSpec.build("h2o", 12, 4), CacheSpec.build("snapkv", 12, 4, window=4, query_window=4)]
    return inspect_prompt(tiny_llama(), NoEosTokenizer(), PROMPT, specs, max_new_tokens=max_new_tokens)


def embedded_data(page: str) -> dict:
    match = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


def test_departure_is_the_first_differing_output_token():
    assert departure([1, 2, 3], [1, 2, 3]) is None
    assert departure([1, 2, 3], [1, 5, 3]) == 1
    assert departure([1, 2, 3], [1, 2]) == 2


def test_the_page_is_self_contained_and_carries_the_trace(tmp_path, one_torch_thread):
    inspection = small_inspection()
    page = render_page(inspection)
    # Nothing to fetch: no external script, style, image or link, only inline ones (and an empty data: icon).
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", page)
    assert "http://" not in page and "https://" not in page and "@import" not in page
    data = embedded_data(page)
    assert [run["name"] for run in data["runs"]] == ["full", "h2o", "snapkv"]
    for run, shown in zip(inspection.runs, data["runs"], strict=True):
        assert "".join(shown["pieces"]) == NoEosTokenizer().decode(run.ids)
        assert len(shown["evictions"]) == len(run.trace.evictions)
        for eviction, raw in zip(run.trace.evictions, shown["evictions"], strict=True):
            kept = np.frombuffer(base64.b64decode(raw["kept"]), dtype=np.uint8)
            assert np.array_equal(kept, eviction.kept.ravel()) and raw["seen"] == eviction.seen
    h2o = inspection.runs[1]
    assert len(h2o.trace.evictions) >= 3
    depart = departure(inspection.runs[0].token_ids, h2o.token_ids)
    assert data["runs"][1]["depart"] == (None if depart is None else len(h2o.prompt_ids) + depart)
    assert data["runs"][1]["settings"]["budget"] == 12 and data["runs"][1]["settings"]["policy"] == "h2o"


def test_the_page_carries_the_policies_signals(one_torch_thread):
    """EPIKV's two bands and VASE's value ranges and reserve reach the page as the trace holds them."""
    specs = [
        CacheSpec.build("epikv", 12, 4),
        CacheSpec.build("vase-attnv", 12, 4, window=4, query_window=4, reserve=4),
    ]
    inspection = inspect_prompt(tiny_llama(), NoEosTokenizer(), PROMPT, specs, max_new_tokens=30)
    data = embedded_data(render_page(inspection))
    expected = {"full": set(), "epikv": {"band_a", "band_b"}, "vase-attnv": {"value_range", "reserve"}}
    for run, shown in zip(inspection.runs, data["runs"], strict=True):
        assert len(shown["evictions"]) == len(run.trace.evictions) >= (0 if run.name == "full" else 3)
        for eviction, raw in zip(run.trace.evictions, shown["evictions"], strict=True):
            assert set(raw["signals"]) == set(eviction.signals) == expected[run.name]
            for name, signal in raw["signals"].items():
                stored = base64.b64decode(signal["data"])
                if signal["kind"] == "set":
                    assert np.array_equal(np.frombuffer(stored, np.uint8), eviction.signals[name].ravel())
                else:
                    values = np.frombuffer(stored, "<f2")
                    assert np.array_equal(values, eviction.signals[name].ravel(), equal_nan=True)
    vase = inspection.runs[2].trace.evictions[-1]
    assert vase.signal("reserve").sum() == 4 * vase.kept_mask().shape[1] * len(inspection.runs[2].trace.evicting)


def test_write_page_overwrites_only_its_own_pages(tmp_path, one_torch_thread):
    inspection = small_inspection(max_new_tokens=20)
    path = write_page(tmp_path / "page.html", inspection)
    write_page(path, inspection)  # its own page: rewritten
    foreign = tmp_path / "notes.html"
    foreign.write_text("<html>mine</html>")
    with pytest.raises(FileExistsError, match="not a page reasonkv inspect wrote"):
        write_page(foreign, inspection)
    assert foreign.read_text() == "<html>mine</html>"
    with pytest.raises(ValueError, match=r"name it \*.html"):
        write_page(tmp_path / "page.txt", inspection)


def test_the_command_decodes_saves_and_rebuilds_from_the_trace(tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.setattr("reasonkv.cli.inspect.load_model_from", lambda args: (tiny_llama(), NoEosTokenizer()))
    out, trace, png = tmp_path / "a.html", tmp_path / "a.npz", tmp_path / "a.png"
    args = ["inspect", "--prompt", PROMPT, "--policies", "h2o,streaming", "--budget", "12", "--buffer", "4"]
    assert (
        main([*args, "--max-new-tokens", "30", "--out", str(out), "--save-trace", str(trace), "--png", str(png)]) == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "b.html"
    monkeypatch.setattr("reasonkv.cli.inspect.load_model_from", lambda args: pytest.fail("no model for a trace"))
    assert main(["inspect", "--trace", str(trace), "--out", str(again)]) == 0
    assert again.read_text() == out.read_text()
    data = embedded_data(out.read_text())
    assert [run["name"] for run in data["runs"]] == ["full", "h2o", "streaming"]
    assert all(len(run["evictions"]) >= 2 for run in data["runs"][1:])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policies", "h2o,nope"], "nope"),
        (["--policies", "full"], "not full itself"),
        (["--png", "figure.jpg"], "expected a .png file name"),
        (["--png-steps", "0"], "count from 1"),
    ],
)
def test_bad_input_is_refused_before_the_model_loads(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("reasonkv.cli.inspect.load_model_from", lambda args: pytest.fail("the model was loaded"))
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "--prompt", "x", "--out", "page.html", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_file_that_is_no_trace_is_refused(tmp_path, capsys):
    (tmp_path / "t.npz").write_bytes(b"junk")
    assert main(["inspect", "--trace", str(tmp_path / "t.npz"), "--out", str(tmp_path / "p.html")]) == 2
    assert "not a reasonkv trace file" in capsys.readouterr().err


def demo_shaped_inspection(seed: int = 0) -> Inspection:
    """Random masks and scores of the demo's shape: the page's size depends on the shape, not the values."""
    rng = np.random.default_rng(seed)
    layers, heads, prompt, new, budget, buffer = 30, 3, 90, 512, 128, 32
    ids = rng.integers(0, 49152, prompt + new).tolist()
    pieces = [f" w{i % 1000}" for i in ids]
    runs = [Run("full", ids[:prompt], ids[prompt:], pieces, Trace(tuple(range(layers)), ("full",) * layers, heads, {}))]
    for name in ("epikv", "h2o", "vase-attnv"):
        evictions = []
        for seen in range(budget + buffer, prompt + new, buffer):
            bits = np.packbits(rng.random((layers, heads, seen)) < 0.3, axis=-1)
            scores = rng.standard_normal((layers, heads, budget + buffer)).astype(np.float16)
            if name == "epikv":  # one kept set: two bands per token
                signals = {band: scores[0, 0] for band in ("band_a", "band_b")}
            elif name == "vase-attnv":  # per layer and head: value ranges and the reserve
                signals = {"value_range": scores, "reserve": bits}
            else:
                signals = {}
            evictions.append(Eviction(seen, bits, bits, bits, scores=scores, signals=signals))
        settings = {"policy": name, "budget": budget, "buffer": buffer}
        trace = Trace(tuple(range(layers)), ("full",) * layers, heads, settings, evictions)
        runs.append(Run(name, ids[:prompt], ids[prompt:], pieces, trace))
    return Inspection("smollm2-135m", runs)


def test_the_demo_page_stays_under_its_size_limit():
    inspection = demo_shaped_inspection()
    assert len(inspection.runs[1].trace.evictions) == 14
    size = len(render_page(inspection).encode())
    assert 1 * 2**20 < size < PAGE_LIMIT_BYTES, size
    assert page_data(inspection)["runs"][1]["settings"]["budget"] == 128


def test_the_command_takes_a_dataset_problem(tmp_path, monkeypatch, capsys, one_torch_thread):
    monkeypatch.setattr("reasonkv.cli.inspect.load_model_from", lambda args: (tiny_llama(), NoEosTokenizer()))
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"id": "q1", "problem": "Half of 10?", "answer": "5"}) + "\n", encoding="utf-8")
    args = ["inspect", "--dataset", str(path), "--policies", "h2o", "--budget", "12", "--buffer", "4"]
    out = tmp_path / "q1.html"
    assert main([*args, "--problem", "q1", "--max-new-tokens", "20", "--out", str(out)]) == 0
    assert "Half of 10?" in "".join(embedded_data(out.read_text())["runs"][0]["pieces"])
    assert main([*args, "--problem", "q9", "--out", str(out)]) == 2
    assert "no problem 'q9'" in capsys.readouterr().err
