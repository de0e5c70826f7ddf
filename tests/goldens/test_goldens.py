"""Behaviour kept: every golden case observed now equals what was recorded (tests/goldens/README.md).

The default run checks a representative few (a policy of each kind, allocations, a tier, a hybrid model, traces,
a command's help, the bench's plans: about 15 seconds); the slow tier checks every case.
"""

from __future__ import annotations

import pytest

from goldens.golden import all_cases, compare_case, load

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


def _cases():
    for case in all_cases():
        fast = case["id"] in FAST or case["kind"] == "plan"
        yield pytest.param(case, id=case["id"], marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("case", _cases())
def test_golden(case):
    if case["kind"] not in STORED:
        STORED[case["kind"]] = load(case["kind"])
    difference = compare_case(case, STORED[case["kind"]].get(case["id"]))
    assert difference is None, f"{case['id']}: {difference}"
