"""The layering the code promises: policies and their floor are engine-free, transformers is met in
few places and only through its public surface, and no module reaches up."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "reasonkv"

# The only modules that import transformers: the run-time seam, the Cache subclass, the loader.
TRANSFORMERS_IMPORTERS = {"hf/model.py", "hf/forward.py", "hf/masks.py", "hf/tap.py", "cache.py", "models.py"}
# Engine-free floor: torch only, and nothing above it.
FLOOR = {
    "contract.py",
    "attention.py",
    "select.py",
    "view.py",
    "recorded.py",
    "calibration.py",
    "quantize.py",
    "tiers.py",
}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _imports(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_transformers_is_imported_only_at_the_seam():
    offenders = {
        name
        for name, tree in _modules()
        if any(i.split(".")[0] == "transformers" for i in _imports(tree)) and name not in TRANSFORMERS_IMPORTERS
    }
    assert not offenders, f"transformers imported outside the seam: {sorted(offenders)}"


def test_policies_and_their_floor_import_nothing_above_them():
    allowed = {"reasonkv." + m.removesuffix(".py").replace("/", ".") for m in FLOOR} | {"reasonkv"}
    for name, tree in _modules():
        if name.startswith("policies/") or name in FLOOR:
            above = {
                i for i in _imports(tree) if i.startswith("reasonkv") and not i.startswith("reasonkv.policies")
            } - allowed
            assert not above, f"{name} reaches up to {sorted(above)}"


def test_eval_bench_analysis_import_nothing_from_the_command_layer():
    for name, tree in _modules():
        if name.split("/")[0] in ("eval", "bench", "analysis", "hf") or name in FLOOR:
            upward = {i for i in _imports(tree) if i.startswith(("reasonkv.commands", "reasonkv.cli"))}
            assert not upward, f"{name} imports the command layer: {sorted(upward)}"


def test_runs_imports_nothing_above_it_and_no_torch():
    for name, tree in _modules():
        if name.startswith("runs/"):
            imported = _imports(tree)
            above = {i for i in imported if i.startswith("reasonkv") and not i.startswith("reasonkv.runs")}
            assert not above, f"{name} reaches up to {sorted(above)}"
            assert not {i for i in imported if i.split(".")[0] == "torch"}, f"{name} imports torch"


# `._name` reads on objects that come from transformers. The one sanctioned read is the model's
# attention implementation, which transformers exposes only as `config._attn_implementation`.
_PRIVATE = re.compile(r"\b(config|model|AttentionInterface|ALL_ATTENTION_FUNCTIONS|AttentionMaskInterface)\)?\._[a-z]")
_SANCTIONED = {("hf/model.py", "text_config(model)._attn_implementation")}


def test_no_private_transformers_attribute_in_src():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            private = _PRIVATE.search(line) or "_global_mapping" in line or "sys.modules[" in line
            if private and not any(name == where and snippet in line for where, snippet in _SANCTIONED):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "private transformers attributes:\n" + "\n".join(found)


_ENGINE_FREE = textwrap.dedent(
    """
    import sys
    sys.modules["transformers"] = None  # any import of transformers now fails
    import torch
    import reasonkv.select, reasonkv.policies, reasonkv.tiers
    from reasonkv.contract import AttentionChunk, ModelInfo, Needs, Step
    from reasonkv.policies import get_policy, list_policies
    from reasonkv.recorded import Recorded
    from reasonkv.view import EvictionView

    torch.manual_seed(0)
    info = ModelInfo(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8)
    batch, slots, budget = 2, 96, 48

    class Layer:
        def __init__(self):
            self.keys = torch.randn(batch, 2, slots, 8)
            self.values = torch.randn(batch, 2, slots, 8)
            self.positions = torch.arange(slots).expand(batch, 2, slots).clone()

    class Storage:  # what a serving engine provides
        def __init__(self):
            self.layers = [Layer() for _ in range(3)]
            self.valid = torch.ones(batch, slots, dtype=torch.bool)
            self.next_position = torch.full((batch,), slots)
            self.prompt_lengths = torch.full((batch,), 4)
            self.row_evictions = torch.zeros(batch, dtype=torch.long)
            self.budget = budget

        def positions(self, layer):
            return self.layers[layer].positions

    storage = Storage()
    scored = []
    for name in list_policies():
        policy = get_policy(name)
        if not policy.evicts:
            continue
        needs = policy.needs(info)
        recorded = Recorded(needs.query_window)
        policy.reset(info, batch, torch.device("cpu"))
        positions = torch.arange(slots).expand(batch, slots)
        valid = torch.ones(batch, slots, dtype=torch.bool)
        prompt = Step(input_valid=valid, input_positions=positions, position_bound=slots)
        for layer in needs.hidden_layers:
            prompt.hidden[layer] = torch.randn(batch, slots, 16)
        policy.observe(prompt)
        for layer in range(3):
            if needs.query_window:
                recorded.push_queries(layer, torch.randn(batch, 4, slots, 8), positions, valid)
            if needs.attention_last or needs.attention_sum:
                rows = torch.softmax(torch.randn(batch, 4, 2, slots), -1)  # two recorded queries
                chunk = AttentionChunk(
                    layer=layer,
                    slot_positions=storage.positions(layer),
                    query_positions=torch.tensor([[slots - 2, slots - 1]] * batch),
                    visible=torch.ones(batch, 2, slots, dtype=torch.bool),
                    position_bound=slots,
                    rows=rows,
                    column_sums=rows.sum(2),
                )
                policy.observe_attention(chunk)
        rows = torch.arange(batch)
        view = EvictionView(cache=storage, recorded=recorded, policy=policy, rows=rows, row_seeds=rows, info=info)
        if policy.granularity == "token":
            kept = [policy.keep(view)]
        else:
            kept = [policy.keep(view.at(layer)) for layer in range(3)]
        assert all(k.shape[-1] == budget for k in kept), name
        scored.append(name)
    print(" ".join(scored))
    """
)


def test_policies_score_with_transformers_unimportable():
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE_FREE], capture_output=True, text=True, cwd=SRC.parents[1], check=False
    )
    assert done.returncode == 0, done.stderr
    from reasonkv.policies import get_policy, list_policies

    evicting = {name for name in list_policies() if get_policy(name).evicts}
    assert set(done.stdout.split()) == evicting
