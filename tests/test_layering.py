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

# The only modules that import transformers: the run-time seam, the Cache and its layer, the loaders (in
# models/, all but the dtype/device checks and the file checks; bundled.py and load.py for type hints only).
TRANSFORMERS_IMPORTERS = (
    "hf/",
    "cache/storage.py",
    "cache/layer.py",
    "cache/static.py",
    "models/shapes.py",
    "models/checkpoint.py",
    "models/gguf.py",
    "models/bundled.py",
    "models/hub.py",
    "models/load.py",
)
# Engine-free: torch only, and nothing above them (the policies and their API, the quantized tier's codes, the
# did-you-mean of unknown names).
ENGINE_FREE = ("policies/", "selection/", "cache/tiers.py", "cache/quantize.py", "suggest/")
MAX_LINES = 600


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _module_name(rel: str) -> str:
    return "reasonkv." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _imports(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _own_edges(tree, known: set[str]) -> set[str]:
    """The reasonkv modules a module imports (``from package import submodule`` counts the submodule)."""
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            edges.update(subs or {node.module})
    return edges


def test_transformers_is_imported_only_at_the_seam():
    offenders = {
        name
        for name, tree in _modules()
        if any(i.split(".")[0] == "transformers" for i in _imports(tree))
        and not name.startswith(TRANSFORMERS_IMPORTERS)
    }
    assert not offenders, f"transformers imported outside the seam: {sorted(offenders)}"


def test_policies_and_their_floor_import_nothing_above_them():
    allowed = tuple(_module_name(m.rstrip("/")) for m in ENGINE_FREE)
    for name, tree in _modules():
        if name.startswith(ENGINE_FREE):
            above = {i for i in _imports(tree) if i.startswith("reasonkv") and not i.startswith(allowed)}
            assert not above, f"{name} reaches up to {sorted(above)}"


def test_only_the_command_line_reads_arguments_and_nothing_imports_it():
    for name, tree in _modules():
        if name.startswith("cli/") or name == "__main__.py":
            continue
        imports = _imports(tree)
        assert "argparse" not in imports, f"{name} reads command-line arguments; only cli/ does"
        upward = {i for i in imports if i.startswith("reasonkv.cli")}
        assert not upward, f"{name} imports the command line: {sorted(upward)}"


def test_no_function_imports_the_package_itself():
    found = []
    for name, tree in _modules():
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
                if any(n.startswith("reasonkv") for n in names) or (isinstance(node, ast.ImportFrom) and node.level):
                    found.append(f"{name}:{node.lineno}")
    assert not found, (
        "imports of reasonkv inside functions (import at the top; a cycle means a misplaced module):\n"
        + "\n".join(found)
    )


def test_no_import_cycles():
    trees = dict(_modules())
    known = {_module_name(rel) for rel in trees}
    graph = {_module_name(rel): _own_edges(tree, known) - {_module_name(rel)} for rel, tree in trees.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, path)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_modules_stay_small_unless_they_are_one_concept():
    big = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and "one concept" not in docstring.lower():
            big.append(f"{path.relative_to(SRC).as_posix()}: {lines} lines")
    assert not big, f"modules over {MAX_LINES} lines whose docstring does not say they are one concept: {big}"


def test_the_root_holds_only_the_entry_points():
    root = {p.name for p in SRC.glob("*.py")}
    assert root <= {"__init__.py", "__main__.py"}, f"modules at the package root: {sorted(root)}"


# The house from the top down, one tier per line (docs/design.md draws it): a module imports its own package
# and the packages of the tiers below its own, never a peer in its tier nor anything above. The package root
# (its version and the names it loads on first use) and the entry points and aliases beside it stand on top.
LAYERS = (
    ("cli",),
    ("integrations",),
    ("calibrate",),
    ("eval", "bench"),
    ("inspect",),
    ("generation",),
    ("cache",),
    ("hf", "models"),
    ("policies", "runs", "sandbox"),
    ("selection", "suggest"),
)


def _upward_imports(modules) -> list[str]:
    tier = {package: depth for depth, packages in enumerate(LAYERS) for package in packages}
    found = []
    for name, tree in modules:
        if "/" not in name:  # the root's modules
            continue
        own = name.split("/")[0]
        for imported in sorted(_imports(tree)):
            parts = imported.split(".")
            if parts[0] != "reasonkv" or len(parts) == 1 or parts[1] == own:
                continue
            if parts[1] not in tier or tier[parts[1]] <= tier[own]:  # a root module, a peer, or above
                found.append(f"{name} imports {imported}")
    return found


def test_every_package_has_its_place_in_the_house():
    packages = {path.relative_to(SRC).parts[0] for path in SRC.rglob("*.py") if path.parent != SRC}
    placed = [package for packages in LAYERS for package in packages]
    assert len(placed) == len(set(placed)) and packages == set(placed), sorted(packages ^ set(placed))


def test_no_module_imports_from_a_layer_above_it():
    found = _upward_imports(_modules())
    assert not found, "imports that reach up or sideways (see LAYERS):\n" + "\n".join(found)


def test_the_layer_check_finds_an_import_up_and_one_sideways():
    modules = [
        ("cache/x.py", ast.parse("from reasonkv.generation import generate\nimport reasonkv.policies.select")),
        ("eval/y.py", ast.parse("from reasonkv.bench import run\nfrom reasonkv import __version__")),
        ("hf/z.py", ast.parse("import reasonkv.select")),
    ]
    assert _upward_imports(modules) == [
        "cache/x.py imports reasonkv.generation",
        "eval/y.py imports reasonkv.bench",
        "hf/z.py imports reasonkv.select",
    ]


# models/ from the bottom up: each module imports only modules of models/ listed before it, and reasonkv's
# modules only at its top.
MODELS_ORDER = ["devices", "files", "shapes", "checkpoint", "gguf", "bundled", "hub", "load", "__init__"]


def test_models_modules_import_downwards_and_at_the_top():
    found = set()
    for name, tree in _modules():
        if not name.startswith("models/"):
            continue
        module = name.removeprefix("models/").removesuffix(".py")
        found.add(module)
        definitions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        inside = {i for node in definitions for i in _imports(node) if i.split(".")[0] == "reasonkv"}
        assert not inside, f"{name} imports {sorted(inside)} inside a function or class"
        own = {i.removeprefix("reasonkv.models.") for i in _imports(tree) if i.startswith("reasonkv.models.")}
        below = set(MODELS_ORDER[: MODELS_ORDER.index(module)])
        assert own <= below, f"{name} imports {sorted(own - below)}, which are not below it"
    assert found == set(MODELS_ORDER)


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
    import reasonkv.policies.select, reasonkv.policies, reasonkv.cache.tiers
    from reasonkv.policies.contract import AttentionChunk, ModelInfo, Needs, Step
    from reasonkv.policies import get_policy, list_policies
    from reasonkv.policies.recorded import Recorded
    from reasonkv.policies.view import EvictionView
    from reasonkv.policies.rotary import Rotary

    torch.manual_seed(0)
    rotary = Rotary("default", tuple(10000.0 ** (-i / 4) for i in range(4)), 1.0, "half", 8)  # the engine's RoPE
    info = ModelInfo(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, rotary=(rotary,) * 3)
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
            self.valid[1, :10] = False  # row 1 is shorter: right-aligned, padding at the left
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
        valid = storage.valid
        if needs.queries:
            for layer in range(3):
                policy.observe_queries(layer, torch.randn(batch, 4, slots, 8), positions, valid)
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
        # [rows, kv_heads, K] or [rows, K] slot indices: the same count in every head, none a padding slot
        assert all(k.shape[-1] == budget for k in kept), name
        assert all(bool(storage.valid[1, k[1]].all()) for k in kept), name
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


def test_a_policy_is_its_file_alone():
    """No list names the policies: every module of policies/ is imported, so a file with a registered class
    is the whole of a new policy (and each registered class comes from a file of its own)."""
    from reasonkv.policies import list_policies, policy_class

    init = ast.parse((SRC / "policies" / "__init__.py").read_text(encoding="utf-8"))
    named = {alias.name for node in ast.walk(init) if isinstance(node, ast.ImportFrom) for alias in node.names}
    files = {p.stem for p in (SRC / "policies").glob("*.py")}
    registering = {stem for stem in files if "@register" in (SRC / "policies" / f"{stem}.py").read_text()}
    assert registering and not named & registering, f"policies/__init__.py names {sorted(named & registering)}"
    sources = {policy_class(name).__module__.rsplit(".", 1)[1] for name in list_policies()}
    assert sources == registering
