"""The README and the docs pages it links: their examples run as written, print what they say, and evict;
their command lines parse; their links lead somewhere."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

import reasonkv
from conftest import NoEosTokenizer, tiny_llama
from reasonkv.calibrate.settings import CalibrateSettings
from reasonkv.cli import main
from reasonkv.cli.main import build_parser
from reasonkv.inspect.runs import Inspection
from reasonkv.policies.registry import _REGISTRY

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))  # the pages the README links (docs/*/README.md: the runs' own notes)


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def bash_commands(*paths: Path) -> list[str]:
    """Every ``reasonkv ...`` command line in the files' bash blocks, continuations joined, comments cut."""
    commands = []
    for path in paths or (README, *PAGES):
        for block in _blocks(path, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("reasonkv "):
                    commands.append(line)
    return commands


def _command(marker: str, *paths: Path) -> list[str]:
    [command] = [c for c in bash_commands(*paths) if marker in c]
    return shlex.split(command)[1:]


def test_every_command_line_of_the_readme_and_its_pages_parses():
    assert len(bash_commands(README)) >= 4 and len(bash_commands(*PAGES)) >= 12
    parser = build_parser()
    for command in bash_commands():
        try:
            parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            pytest.fail(f"command does not parse: {command}")


def test_every_relative_link_of_the_readme_and_its_pages_leads_to_a_file():
    for path in (README, *PAGES):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to {target}, which is missing"


def test_writing_a_policy_example_registers_and_runs():
    [example] = [block for block in _blocks(API, "python") if "@reasonkv.register" in block]
    namespace: dict = {}
    exec(compile(example, "docs/api.md", "exec"), namespace)
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


def _printed_and_promised(block: str) -> list[tuple[str, str]]:
    """``(print call, the comment line under it)`` for every print of a README example: the comment starts
    with what the print writes (``...`` standing for figures that vary, such as tokens/s), then ``:``."""
    lines = block.splitlines()
    return [
        (line, _before_colon(lines[i + 1][2:]))
        for i, line in enumerate(lines)
        if line.startswith("print(") and i + 1 < len(lines) and lines[i + 1].startswith("# ")
    ]


def _before_colon(comment: str) -> str:
    """``comment`` up to its first ``": "`` outside braces (a printed dict holds some)."""
    depth = 0
    for i, char in enumerate(comment):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0 and comment.startswith(": ", i):
            return comment[:i]
    return comment


def _matches(printed: str, promised: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in promised.split("..."))
    return re.fullmatch(pattern, printed) is not None


@pytest.mark.integration
@pytest.mark.slow  # minutes on 2 cores: the quick-start generate below keeps a README run in the default tier
def test_the_readme_python_api_example_prints_what_its_comments_say():
    """The README's API example, run as written (its own budgets, tiers and token limits): each print writes
    the figures of the comment under it; the first shows the K + B bound, the second a tier that holds more
    tokens than full precision would in its bytes."""
    [block] = [b for b in _blocks(README, "python") if "reasonkv.generate(" in b and "load_model" in b]
    promised = _printed_and_promised(block)
    assert len(promised) == 2
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), namespace)
    printed = out.getvalue().splitlines()
    assert len(printed) == len(promised)
    for line, (_, expected) in zip(printed, promised, strict=True):
        assert _matches(line, expected), f"the README says {expected!r}, the example printed {line!r}"
    # The tier's saving, as the comment computes it: the bytes held stay below those of the tokens held
    # at full precision (46,080 bytes per token: fp32 K and V, 30 layers x 3 kv heads x 64 dims).
    tiered = re.fullmatch(r"(\d+) (\d+) (\{.*\})", printed[1])
    held, by_tier = int(tiered.group(2)), ast.literal_eval(tiered.group(3))
    assert sum(by_tier.values()) < held * 46080 and by_tier["quantized"] > 0
    assert namespace["result"].stats["evictions"] > 0  # the CacheSpec example evicts too


@pytest.mark.integration
@pytest.mark.slow  # minutes on 2 cores: the quick-start generate below keeps a README run in the default tier
def test_the_model_generate_example_of_the_api_page_runs_and_evicts():
    """docs/api.md's ``model.generate`` example, with the README's model and question and 40 new tokens."""
    [readme_block] = [b for b in _blocks(README, "python") if "reasonkv.generate(" in b and "load_model" in b]
    namespace: dict = {}
    exec(compile(readme_block.split("[result] =")[0], "README.md", "exec"), namespace)  # model and question
    [block] = [b for b in _blocks(API, "python") if "model.generate(" in b]
    assert block.count("max_new_tokens=256") == 1
    exec(compile(block.replace("max_new_tokens=256", "max_new_tokens=40"), "docs/api.md", "exec"), namespace)
    cache = namespace["cache"]
    assert cache.evictions > 0 and cache.peak_slots <= 80
    batch, kv_heads, slots = cache.positions(0).shape
    assert (batch, kv_heads) == (1, 3) and 64 <= slots <= 80  # K after the last eviction, then what came since


@pytest.mark.integration
def test_the_quick_start_generate_evicts_and_prints_what_the_readme_says(capsys):
    argv = _command("generate --prompt", README)
    assert main(argv) == 0
    out = capsys.readouterr()
    [summary] = [line for line in (out.out + out.err).splitlines() if line.startswith("[h2o K=64 B=16]")]
    evictions = int(re.search(r"(\d+) evictions", summary).group(1))
    assert evictions > 0
    promised = re.search(r"ends with the line `(\[h2o[^`]*)`", README.read_text(encoding="utf-8")).group(1)
    assert _matches(summary, promised), f"the README says {promised!r}, generate printed {summary!r}"


@pytest.mark.integration
@pytest.mark.slow  # minutes on 2 cores: the quick-start generate below keeps a README run in the default tier
def test_the_quick_start_inspect_evicts_in_every_policy(tmp_path):
    argv = _command("inspect --prompt", README)
    argv[argv.index("--out") + 1] = str(tmp_path / "page.html")
    assert main([*argv, "--save-trace", str(tmp_path / "runs.npz")]) == 0
    assert (tmp_path / "page.html").stat().st_size > 0
    runs = Inspection.load(tmp_path / "runs.npz").runs
    policies = argv[argv.index("--policies") + 1].split(",")
    assert [run.name for run in runs] == ["full", *policies]
    for run in runs[1:]:
        assert len(run.trace.evictions) > 0, f"{run.name} did not evict in the README's inspect example"


def test_the_quick_start_eval_grid_evicted_in_every_record_of_its_committed_run():
    """The README's eval example is the grid of ``docs/results`` (there in bf16): every record of its
    evicting policies at its budgets evicted."""
    argv = _command("eval --dataset", README)
    grid = {flag: argv[argv.index(flag) + 1] for flag in ("--dataset", "--policies", "--budgets", "--buffer")}
    grid["--max-new-tokens"] = argv[argv.index("--max-new-tokens") + 1]
    datasets = {part.split(":")[0]: int(part.split(":")[1]) for part in grid["--dataset"].split(",")}
    budgets = {int(b) for b in grid["--budgets"].split(",")}
    records: dict[tuple, list[int]] = {}
    with open(ROOT / "docs" / "results" / "results.jsonl", encoding="utf-8") as file:
        for line in file:
            record = json.loads(line)
            if record.get("kind") != "generation" or record["policy"] == "full":
                continue
            assert record["buffer"] == int(grid["--buffer"])
            assert record["max_new_tokens"] == int(grid["--max-new-tokens"])
            records.setdefault((record["policy"], record["budget"], record["dataset"]), []).append(record["evictions"])
    for policy in grid["--policies"].split(","):
        if policy == "full":
            continue
        for budget in budgets:
            for dataset, count in datasets.items():
                evictions = records[(policy, budget, dataset)]
                assert len(evictions) == count and min(evictions) > 0, (policy, budget, dataset)


def test_the_first_gpu_step_runs_as_written_on_the_tiny_shape(tmp_path, capsys):
    """docs/gpu.md's first GPU command, on the CPU and the tiny shape at small sizes: it prints the rate."""
    argv = _command("--out runs/first-step")
    assert argv[argv.index("--model") + 1] == "shape:llama-3.1-8b" and argv[argv.index("--device") + 1] == "cuda"
    small = {"--model": "shape:tiny", "--device": "cpu", "--dtype": "fp32", "--budget": "32", "--buffer": "16"}
    small |= {"--batch-sizes": "2", "--lengths": "64", "--decode-steps": "8", "--out": str(tmp_path / "first")}
    for flag, value in small.items():
        argv[argv.index(flag) + 1] = value
    assert main(argv) == 0
    err = capsys.readouterr().err
    rates = re.findall(
        r"\] sweep epikv batch 2 \(round (\d) of 3\) \.\.\.\n +[0-9.]+ tok/s, [0-9.]+ ms/step at 64", err
    )
    assert rates == ["1", "2", "3"]  # the three rates docs/gpu.md says to take the median of


def test_the_calibrate_command_uses_the_default_number_of_traces():
    argv = _command("calibrate --dataset gsm8k --traces")
    assert int(argv[argv.index("--traces") + 1]) == CalibrateSettings.__dataclass_fields__["traces"].default
