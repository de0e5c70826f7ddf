"""The README's examples run as written and its command lines parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.calibrate.settings import CalibrateSettings
from reasonkv.cli import main
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
def test_python_api_examples_run_as_written_and_evict():
    """The examples of the README's Python API section, with 40 new tokens instead of 256: their printed
    figures show what they demonstrate (evictions, the K + B bound, a filled quantized tier)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    generate_block = next(b for b in blocks if "reasonkv.generate(" in b and "load_model" in b)
    cache_block = next(b for b in blocks if "model.generate(" in b)
    assert generate_block.count("max_new_tokens=256") == 3 and cache_block.count("max_new_tokens=256") == 1
    namespace: dict = {}
    tier_at, spec_at = generate_block.index("# Keep more"), generate_block.index("# The same settings")
    parts = [generate_block[:tier_at], generate_block[tier_at:spec_at], generate_block[spec_at:]]
    results = []
    for part in parts:  # as written, one example after the other, with fewer new tokens
        exec(compile(part.replace("max_new_tokens=256", "max_new_tokens=40"), "README.md", "exec"), namespace)
        results.append(namespace["result"])
    first, tiered, spec = results
    tokenizer, prompt = namespace["tokenizer"], namespace["prompt"]
    assert len(tokenizer(prompt)["input_ids"]) == 73 <= 80  # the prompt fits in K + B: the bound shows
    for h2o in (first, spec):
        assert h2o.num_tokens == 40 and h2o.stats["evictions"] == (73 + 39 - 80) // 16 + 1
        assert h2o.stats["peak_row_tokens"] == 80 and h2o.stats["tokens_per_second"] > 0
    assert tiered.stats["evictions"] > 0 and tiered.stats["peak_kv_bytes_by_tier"]["quantized"] > 0
    exec(compile(cache_block.replace("max_new_tokens=256", "max_new_tokens=40"), "README.md", "exec"), namespace)
    cache = namespace["cache"]
    assert cache.evictions > 0 and cache.peak_slots <= 80
    batch, kv_heads, slots = cache.positions(0).shape
    assert (batch, kv_heads) == (1, 3) and 64 <= slots <= 80  # K after the last eviction, then what came since


def _command(marker: str) -> list[str]:
    [command] = [c for c in bash_commands() if marker in c]
    return shlex.split(command)[1:]


def test_the_first_gpu_step_runs_as_written_on_the_tiny_shape(tmp_path, capsys):
    """The README's first GPU command, on the CPU and the tiny shape at small sizes: it prints the rate."""
    argv = _command("--out runs/first-step")
    assert argv[argv.index("--model") + 1] == "shape:llama-3.1-8b" and argv[argv.index("--device") + 1] == "cuda"
    small = {"--model": "shape:tiny", "--device": "cpu", "--dtype": "fp32", "--budget": "32", "--buffer": "16"}
    small |= {"--batch-sizes": "2", "--lengths": "64", "--decode-steps": "8", "--out": str(tmp_path / "first")}
    for flag, value in small.items():
        argv[argv.index(flag) + 1] = value
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[3/3] sweep epikv batch 2 ..." in err
    assert re.search(r"\[3/3\] sweep epikv batch 2 \.\.\.\n +[0-9.]+ tok/s, [0-9.]+ ms/step at 64", err)


def test_the_readme_calibrate_command_uses_the_default_number_of_traces():
    argv = _command("calibrate --dataset gsm8k --traces")
    assert int(argv[argv.index("--traces") + 1]) == CalibrateSettings.__dataclass_fields__["traces"].default
