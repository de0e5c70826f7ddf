"""Behaviour kept: every golden case observed now equals what was recorded (tests/goldens/README.md).

The default run checks a representative few (a policy of each kind, allocations, a tier, a hybrid model, traces,
a command's help, the bench's plans: about 15 seconds); the slow tier checks every case.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from goldens.golden import all_cases, compare_case, load
from goldens.pinned import pinned_environment

SCRIPT = Path(__file__).resolve().parent / "golden.py"

FAST = {
    "decode/llama/h2o/uniform",
    "decode/llama/h2o/uniform/tier",
    "decode/llama/h2o/adaptive",
    "decode/llama/vase-attnv/pyramid",
    "decode/llama/quest/uniform",
    "decode/gemma3/snapkv/adaptive",
    "trace/llama/h2o/adaptive",
    "trace/gemma3/quest/uniform",
    "help/generate --help",
}
STORED: dict[str, dict] = {}
OBSERVED: dict[str, dict] = {}


def _cases():
    for case in all_cases():
        fast = case["id"] in FAST or case["kind"] == "plan"
        yield pytest.param(case, id=case["id"], marks=() if fast else pytest.mark.slow)


def _observe_session_cases(session) -> None:
    """Observe every golden case this session runs, in one child process in the pinned numeric environment
    (:mod:`goldens.pinned`: this process's torch has already started with the machine's own kernels)."""
    ids = [item.callspec.params["case"]["id"] for item in session.items if item.originalname == "test_golden"]
    with tempfile.TemporaryDirectory() as folder:
        wanted, out = Path(folder) / "ids.json", Path(folder) / "observed.json"
        wanted.write_text(json.dumps(ids))
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "observe", "--ids", str(wanted), "--out", str(out)],
            env=pinned_environment(),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            raise RuntimeError(f"observing the golden cases failed:\n{done.stderr[-3000:]}")
        OBSERVED.update(json.loads(out.read_text()))


@pytest.mark.parametrize("case", _cases())
def test_golden(case, request):
    if not OBSERVED:
        _observe_session_cases(request.session)
    if case["kind"] not in STORED:
        STORED[case["kind"]] = load(case["kind"])
    difference = compare_case(case, STORED[case["kind"]].get(case["id"]), OBSERVED[case["id"]])
    assert difference is None, f"{case['id']}: {difference}"
