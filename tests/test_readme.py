"""The README's custom-policy example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.policies import _REGISTRY

README = Path(__file__).resolve().parents[1] / "README.md"


def test_writing_a_policy_example_registers_and_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    [example] = [block for block in blocks if "@reasonkv.register" in block]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    name = next(
        cls.name
        for cls in namespace.values()
        if isinstance(cls, type) and issubclass(cls, reasonkv.Policy) and cls is not reasonkv.Policy
    )
    try:
        [result] = reasonkv.generate(
            tiny_llama(),
            NoEosTokenizer(),
            "a prompt of some length",
            policy=name,
            budget=8,
            buffer=4,
            max_new_tokens=20,
        )
        assert result.stats["evictions"] > 0 and result.stats["peak_slots"] <= 23
    finally:
        _REGISTRY.pop(name, None)
