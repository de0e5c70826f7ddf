"""The run manifest: what it holds, and resuming with another setup refused (naming what differs)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

from conftest import NoEosTokenizer, tiny_llama
from reasonkv.eval.environment import weights_sha256
from reasonkv.eval.manifest import grid_identity, grid_sha256, manifest_id
from reasonkv.eval.runner import run_grid
from reasonkv.runs.store import read_records

REPO = Path(__file__).resolve().parents[2]
PROBLEMS = [
    {"id": "p1", "problem": "What is 2+2?", "answer": "4", "solution": "2+2 = <<2+2=4>>4.\n#### 4"},
    {"id": "p2", "problem": "Half of 10?", "answer": "5"},
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return path


def _grid(dataset, out, **overrides) -> dict:
    kwargs = dict(
        dataset=str(dataset), out=str(out), policies="full,streaming", budgets=[10], buffer=4, max_new_tokens=6,
        batch_size=4, progress=False, fidelity=False,
    )  # fmt: skip
    kwargs.update(overrides)
    return kwargs


def test_the_manifest_holds_what_reproduces_the_run(dataset, tmp_path):
    model = tiny_llama()
    out = tmp_path / "r.jsonl"
    command = ["reasonkv", "eval", "--dataset", str(dataset)]
    settings = dict(temperature=0.5, top_p=0.9, top_k=7, seed=3)
    run_grid(model, NoEosTokenizer(), **_grid(dataset, out, **settings), command=command)
    manifest = read_records(out)[0]
    assert manifest["kind"] == "manifest" and manifest["tool"] == "reasonkv" and len(manifest["id"]) == 16
    setup = manifest["setup"]
    assert setup["weights_sha256"] == weights_sha256(model) == weights_sha256(tiny_llama())  # values, not objects
    assert setup["weights_sha256"] != weights_sha256(tiny_llama(seed=1))
    assert (setup["dtype"], setup["attn_implementation"], setup["prompt_format"]) == ("fp32", "sdpa", "plain")
    assert (setup["max_new_tokens"], setup["temperature"], setup["top_p"], setup["top_k"], setup["seed"]) == (
        6,
        0.5,
        0.9,
        7,
        3,
    )
    env = manifest["environment"]
    assert (env["torch"], env["transformers"], env["device"]) == (torch.__version__, transformers.__version__, "cpu")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # the sources are a git checkout
        assert env["git_commit"] == head.stdout.strip() and isinstance(env["git_dirty"], bool)
    [entry] = manifest["grid"]["datasets"]
    assert entry["sha256"] == hashlib.sha256(dataset.read_bytes()).hexdigest()
    assert (entry["problems"], entry["samples"], entry["limit"]) == (2, 1, None)
    assert [(p["label"], p["budget"], p["config"]["policy"]) for p in manifest["grid"]["policies"]] == [
        ("full", None, "full"),
        ("streaming", 10, "streaming"),
    ]
    # the machine's paths are recorded relative to the run's folder (here the dataset sits beside the results)
    assert entry["file"] == "problems.jsonl"
    assert manifest["command"] == ["reasonkv", "eval", "--dataset", "problems.jsonl"]
    assert manifest["launch"] == {"world_size": 1}
    assert all(r["run"] == manifest["id"] for r in read_records(out)[1:])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(model=lambda: tiny_llama(dtype=torch.bfloat16)), "dtype: 'fp32' there, 'bf16' now"),
        (dict(model=lambda: tiny_llama(seed=1)), "weights_sha256"),
        (dict(temperature=0.7), "temperature: 0.0 there, 0.7 now"),
        (dict(max_new_tokens=8), "max_new_tokens: 6 there, 8 now"),
        (dict(seed=5), "seed: 0 there, 5 now"),
        (dict(model_name="another-model"), "model: 'LlamaForCausalLM' there, 'another-model' now"),
    ],
)
def test_resuming_with_another_setup_is_refused_naming_what_differs(dataset, tmp_path, change, named):
    out = tmp_path / "r.jsonl"
    run_grid(tiny_llama(), NoEosTokenizer(), **_grid(dataset, out))
    before = out.read_bytes()
    make = change.pop("model", tiny_llama)
    with pytest.raises(ValueError, match="holds results of another setup") as error:
        run_grid(make(), NoEosTokenizer(), **_grid(dataset, out, **change))
    assert named in str(error.value)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["problems.jsonl", "r.jsonl"]


def test_a_changed_dataset_file_is_refused_and_a_larger_grid_is_new_work(dataset, tmp_path):
    out = tmp_path / "r.jsonl"
    model = tiny_llama()
    run_grid(model, NoEosTokenizer(), **_grid(dataset, out, limit=1))
    grown = run_grid(model, NoEosTokenizer(), **_grid(dataset, out, budgets=[10, 12]))  # more problems, a budget
    assert grown.skipped == 2 and grown.generated == 4
    manifests = [r for r in read_records(out) if r["kind"] == "manifest"]
    assert len(manifests) == 2 and manifests[0]["setup"] == manifests[1]["setup"]
    before = out.read_bytes()
    dataset.write_text(dataset.read_text(encoding="utf-8").replace("Half of 10", "Half of 12"), encoding="utf-8")
    with pytest.raises(ValueError, match=f"dataset {dataset} sha256"):
        run_grid(model, NoEosTokenizer(), **_grid(dataset, out))
    assert out.read_bytes() == before


def test_another_environment_is_accepted_with_a_warning_and_its_own_manifest(dataset, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    model = tiny_llama()
    run_grid(model, NoEosTokenizer(), **_grid(dataset, out, limit=1))
    lines = out.read_text(encoding="utf-8").splitlines()
    first = json.loads(lines[0])
    first["environment"]["torch"] = "1.0.0"  # as if written with another torch (whose manifest has its own id)
    first["id"] = manifest_id(first)
    records = [{**json.loads(line), "run": first["id"]} for line in lines[1:]]  # written by that run
    out.write_text("".join(json.dumps(r) + "\n" for r in [first, *records]), encoding="utf-8")
    capsys.readouterr()
    again = run_grid(model, NoEosTokenizer(), **_grid(dataset, out, limit=1))
    assert again.skipped == 2 and again.generated == 0  # the same work: nothing to redo
    assert f"torch: '1.0.0' there, '{torch.__version__}' now" in capsys.readouterr().err
    manifests = [r for r in read_records(out) if r["kind"] == "manifest"]
    assert [m["environment"]["torch"] for m in manifests] == ["1.0.0", torch.__version__]


def test_a_shard_of_another_setup_is_refused_before_the_model_loads(dataset, tmp_path):
    out = tmp_path / "r.jsonl"
    run_grid(tiny_llama(), NoEosTokenizer(), **_grid(dataset, out), shard=(0, 2))
    with pytest.raises(
        ValueError, match="r.shard-0-of-2.jsonl holds results of another setup .dtype: 'fp32' there, 'bf16'"
    ):
        run_grid("no-such-model", model_name="LlamaForCausalLM", dtype="bf16", **_grid(dataset, out), shard=(1, 2))
    # (refused before loading: no such model exists)
    assert not (tmp_path / "r.shard-1-of-2.jsonl").exists()
    assert json.loads((tmp_path / "r.plan.json").read_text())["dtype"] == "fp32"  # the refused one changed nothing


def test_the_manifest_holds_the_grids_identity_known_before_any_model_loads(dataset, tmp_path):
    out = tmp_path / "r.jsonl"
    run_grid(tiny_llama(), NoEosTokenizer(), **_grid(dataset, out))
    manifest = read_records(out)[0]
    identity = grid_identity(manifest["grid"], manifest["setup"])
    assert manifest["grid"]["sha256"] == grid_sha256(identity) and manifest["grid"]["generation"] is True
    assert [p["label"] for p in identity["policies"]] == ["full", "streaming"] and identity["max_new_tokens"] == 6
    resumed = run_grid(tiny_llama(), NoEosTokenizer(), **_grid(dataset, out, batch_size=1))  # not part of the grid
    assert resumed.skipped == 4 and read_records(out)[0]["grid"]["sha256"] == manifest["grid"]["sha256"]
