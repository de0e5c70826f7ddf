"""The README's examples run as written and its command lines parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.cli.main import build_parser
from reasonkv.policies.registry import _REGISTRY

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


def bash_commands() -> list[str]:
    """Every ``reasonkv ...`` command line in the README's bash blocks, continuations joined, comments cut."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("reasonkv "):
                commands.append(line)
    return commands


def test_every_readme_command_line_parses():
    commands = bash_commands()
    assert len(commands) >= 12
    parser = build_parser()
    for command in commands:
        try:
            parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            pytest.fail(f"README command does not parse: {command}")


@pytest.mark.integration
def test_python_api_examples_run_as_written():
    """The two examples of the README's Python API section, with fewer new tokens."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    generate_block = next(b for b in blocks if "reasonkv.generate(" in b and "load_model" in b)
    cache_block = next(b for b in blocks if "model.generate(" in b)
    namespace: dict = {}
    exec(compile(generate_block.replace("max_new_tokens=1024", "max_new_tokens=24"), "README.md", "exec"), namespace)
    result = namespace["result"]
    assert result.num_tokens <= 24 and result.text.strip() and result.stats["tokens_per_second"] > 0
    namespace["inputs"] = namespace["tokenizer"](namespace["prompt"], return_tensors="pt")
    exec(compile(cache_block.replace("max_new_tokens=1024", "max_new_tokens=24"), "README.md", "exec"), namespace)
    cache = namespace["cache"]
    assert cache.peak_slots <= namespace["inputs"]["input_ids"].shape[1] + 24
    assert tuple(cache.positions(0).shape[:2]) == (1, 3)  # [batch, kv_heads, slots]
