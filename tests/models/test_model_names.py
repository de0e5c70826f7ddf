"""Which kind of name load_model was given: paths and .gguf files that do not exist, invalid names, hub ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import save_tiny_checkpoint
from reasonkv.models import load_model

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("name", ["/no/such/checkpoint", "./missing-dir", "~/no-such-reasonkv-model/x"])
def test_missing_local_path(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        load_model(name)
    assert repr(name) in str(info.value)


def test_missing_gguf_file(tmp_path: Path) -> None:
    missing = tmp_path / "model.Q4_0.gguf"
    with pytest.raises(FileNotFoundError, match="GGUF file not found") as info:
        load_model(missing)
    assert str(missing) in str(info.value)


def test_invalid_name() -> None:
    with pytest.raises(ValueError, match="'not a model!'"):
        load_model("not a model!")
    with pytest.raises(ValueError, match="non-empty"):
        load_model("  ")


def test_unresolvable_hub_id_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Offline mode makes the hub lookup fail at once instead of retrying over the network.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    name = "reasonkv-test-org/no-such-model"
    with pytest.raises(OSError, match="Cannot load model") as info:
        load_model(name)
    assert repr(name) in str(info.value)
    assert "shape:<name>" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


# --------------------------------------------------------------------------- hub ids without a hub

OFFLINE_SCRIPT = """
import json, sys, time
from reasonkv.models import load_model
report = {}
start = time.perf_counter()
model, tokenizer = load_model("reasonkv-test-org/cached-model")
report["cached_s"] = time.perf_counter() - start
report["cached_ids"] = tokenizer("the cat sat")["input_ids"]
start = time.perf_counter()
try:
    load_model("reasonkv-test-org/no-such-model")
except OSError as error:
    report["unknown_error"] = str(error)
report["unknown_s"] = time.perf_counter() - start
print(json.dumps(report))
"""


@pytest.mark.slow
def test_hub_ids_without_a_reachable_hub(tmp_path: Path) -> None:
    """A hub id in the local cache loads, an unknown one fails, both without retrying a hub that is not there."""
    hub_cache = tmp_path / "hub"
    repo = hub_cache / "models--reasonkv-test-org--cached-model"
    commit = "0" * 40
    save_tiny_checkpoint(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_CACHE": str(hub_cache),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing answers there: as on a machine without network
    }
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["cached_ids"] == [3, 4, 5]
    assert "the hub cannot be reached and the local cache does not hold it" in report["unknown_error"]
    # The hub client waits 1 + 2 + 4 + 8 + 8 s between its retries of each file: none may happen. The
    # times are only a loose check, since a busy machine slows the loads themselves.
    assert "Retrying in" not in done.stderr, done.stderr[-3000:]
    assert report["cached_s"] < 60 and report["unknown_s"] < 20, report
