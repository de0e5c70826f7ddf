"""The golden cases: what reasonkv did, recorded once, so that a change of structure can prove it kept behaviour.

Five kinds, each a function from a case to a JSON-able observation:

- ``decode``: every policy x allocation x quantized tier x eager / compiled on a tiny Llama and a tiny hybrid
  (Gemma 3 style) model, three ragged token-id prompts, many evictions: the tokens, each row's stats (times
  left out) and, after every forward, a digest of the positions each (row, layer, kv-head) holds, per tier;
  a refused case records that it was refused;
- ``trace``: the eviction traces ``generate(trace=True)`` records, every array's digest and the settings;
- ``eval``: a small ``reasonkv eval`` grid's JSONL on a tiny checkpoint (volatile fields left out);
- ``help``: every command's ``--help``;
- ``plan``: the configurations ``reasonkv bench`` plans for a set of command lines.

Only public entry points are used (``reasonkv.generate``, the cache's ``positions``, the command line), so the
same observation can be made before and after a change. :mod:`golden` records and compares them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import reasonkv  # noqa: E402
from conftest import tiny_gemma3, tiny_llama  # noqa: E402
from reasonkv.policies import policy_class  # noqa: E402

DATA = HERE / "data"
BUDGET, BUFFER, NEW_TOKENS, SEEDS = 12, 4, 40, [3, 4, 5]
TIER = dict(quantized=16, bits=4, group_size=4)
ALLOCATIONS = ("uniform", "pyramid", "adaptive", "calibrated")
# Left out of the stats: they measure time or the process, not what the cache did.
VOLATILE_STATS = {"prefill_seconds", "decode_seconds", "tokens_per_second", "peak_memory_bytes", "timings"}


def prompts() -> list[list[int]]:
    """Three ragged prompts (9, 20 and 33 tokens), ids inside the tiny models' vocabulary."""
    return [[3 + (7 * i + 11 * r) % 90 for i in range(n)] for r, n in enumerate((9, 20, 33))]


@cache
def model(name: str):
    return {"llama": tiny_llama, "gemma3": tiny_gemma3}[name]()


def budgets_file(name: str) -> str:
    """The calibrated allocation's file for ``name`` (weights per evicting layer and kv-head)."""
    return str(DATA / f"budgets-{name}.json")


def options(policy: str, model_name: str) -> dict:
    """Windows shrunk to fit K = 12; selection reads blocks of 4; seer's gate is a random one of this model's."""
    defaults = policy_class(policy).options()
    out = {}
    if defaults.get("window", 0) > 4:
        out["window"] = 4
    if defaults.get("protect_prompt"):
        out["protect_prompt"] = False
    if policy_class(policy).selects:
        out["block_size"] = 4
    if policy == "seer":
        out["gates"] = str(DATA / f"gate-{model_name}.pt")
    return out


# ---------------------------------------------------------------------------------------------------- decode
def decode_cases() -> list[dict]:
    cases = []
    for model_name in ("llama", "gemma3"):
        for name in reasonkv.list_policies():
            cls = policy_class(name)
            cases.append(dict(kind="decode", model=model_name, policy=name, allocation="uniform", tier=False))
            if cls.evicts:
                for allocation in ALLOCATIONS[1:]:
                    cases.append(dict(kind="decode", model=model_name, policy=name, allocation=allocation, tier=False))
                if cls.can_rank():
                    cases.append(dict(kind="decode", model=model_name, policy=name, allocation="uniform", tier=True))
            if model_name == "llama" or name in ("h2o", "streaming", "full"):
                cases.append(
                    dict(kind="decode", model=model_name, policy=name, allocation="uniform", tier=False, compile=True)
                )
        # triattention's default keeps one set for every layer, refused under an allocation: its per-layer option.
        for allocation in ALLOCATIONS[1:]:
            cases.append(
                dict(kind="decode", model=model_name, policy="triattention", allocation=allocation, tier=False,
                     options={"selection": "per-layer-head"})
            )  # fmt: skip
        # Compiled decode where it falls back to eager or is refused: a tier, an allocation, selection.
        for extra in (dict(tier=True, allocation="uniform"), dict(tier=False, allocation="pyramid")):
            cases.append(dict(kind="decode", model=model_name, policy="h2o", compile=True, **extra))
    for case in cases:
        case.setdefault("compile", False)
        case.setdefault("options", {})
        case["id"] = "decode/{model}/{policy}/{allocation}{t}{c}{o}".format(
            **case,
            t="/tier" if case["tier"] else "",
            c="/compiled" if case["compile"] else "",
            o="".join(f"/{value}" for value in case["options"].values()),
        )
    return cases


def _kept(cache) -> list:
    """Per row, layer and kv-head: the sorted positions held at full precision and, with a tier, in it."""
    out = []
    width = getattr(cache, "low_width", 0)
    for layer in cache.full_layers:
        positions = cache.positions(layer).cpu()
        tier, full = positions[..., :width], positions[..., width:]
        for part in (full, tier) if width else (full,):
            held = torch.where(part >= 0, part, torch.iinfo(torch.long).max).sort(-1).values
            out.append([[[p for p in head.tolist() if p >= 0] for head in row] for row in held])
    return out


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:16]


def _stats(stats: dict) -> dict:
    out = {k: v for k, v in stats.items() if k not in VOLATILE_STATS}
    if isinstance(out.get("compile"), dict):
        out["compile"] = {k: v for k, v in out["compile"].items() if k != "warmup_seconds"}
    return json.loads(json.dumps(out, default=str))


def _cache_keywords(case: dict) -> dict:
    keywords = dict(
        policy=case["policy"], budget=BUDGET, buffer=BUFFER, seed=SEEDS, **options(case["policy"], case["model"])
    )
    keywords.update(case.get("options", {}))
    if case["allocation"] != "uniform":
        keywords["allocation"] = case["allocation"]
    if case["allocation"] == "calibrated":
        keywords["budgets_file"] = budgets_file(case["model"])
    if case["tier"]:
        keywords.update(TIER)
    return keywords


def run_decode(case: dict) -> dict:
    digests: list[str] = []

    def on_step(step, cache):
        digests.append(_digest(_kept(cache)))

    if case["compile"]:
        # Compiled through aot_eager: the fixed-shape layout, the graph capture and the compiled step's signals,
        # on eager kernels (inductor's generated code sums in orders that change from run to run and with the
        # cases compiled before). Each case compiles afresh, so its compilation count does not depend on order.
        torch._dynamo.reset()
    try:
        results = reasonkv.generate(
            model(case["model"]),
            None,
            prompts(),
            max_new_tokens=NEW_TOKENS,
            on_step=on_step,
            compile="aot_eager" if case["compile"] else False,
            **_cache_keywords(case),
        )
    except ValueError as error:
        return {"refused": type(error).__name__, "message": str(error)}
    return {
        "tokens": [r.token_ids for r in results],
        "finish": [r.finish_reason for r in results],
        "stats": [_stats(r.stats) for r in results],
        "kept": digests,
    }


# ---------------------------------------------------------------------------------------------------- traces
def trace_cases() -> list[dict]:
    cases = []
    for model_name in ("llama", "gemma3"):
        for name in ("h2o", "snapkv", "epikv", "vase-attnv", "streaming", "triattention", "quest", "seer"):
            allocations = ("uniform",) if policy_class(name).selects else ("uniform", "adaptive", "pyramid")
            for allocation in allocations:
                if name == "triattention" and allocation != "uniform":
                    continue
                cases.append(dict(kind="trace", model=model_name, policy=name, allocation=allocation, tier=False))
        cases.append(dict(kind="trace", model=model_name, policy="h2o", allocation="uniform", tier=True))
    for case in cases:
        case["id"] = "trace/{model}/{policy}/{allocation}{t}".format(**case, t="/tier" if case["tier"] else "")
    return cases


def run_trace(case: dict) -> dict:
    from reasonkv.inspect.trace import save_trace

    try:
        results = reasonkv.generate(
            model(case["model"]), None, prompts(), max_new_tokens=NEW_TOKENS, trace=True, **_cache_keywords(case)
        )
    except ValueError as error:
        return {"refused": type(error).__name__, "message": str(error)}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.npz"
        save_trace(path, {f"row{r}": {"trace": result.trace} for r, result in enumerate(results)})
        data = np.load(path, allow_pickle=False)
        meta = json.loads(bytes(data["meta"]).decode())
        arrays = {key: _array_digest(data[key]) for key in sorted(data.files) if key != "meta"}
    for run in meta["runs"].values():  # the files' paths are where this checkout is
        for key in ("budgets_file", "gates"):
            if key in run["settings"]:
                run["settings"][key] = Path(run["settings"][key]).name
    return {"meta": meta, "arrays": arrays}


def _array_digest(array: np.ndarray) -> str:
    array = np.ascontiguousarray(array)
    body = hashlib.sha256(array.tobytes()).hexdigest()[:16]
    return f"{array.dtype}{list(array.shape)}:{body}"


# ---------------------------------------------------------------------------------------------------- eval
EVAL_ARGS = [
    "--dataset", "gsm8k:2", "--policies", "full,h2o,streaming,vase-attnv", "--budgets", "16", "--buffer", "8",
    "--allocations", "uniform,adaptive", "-o", "vase-attnv.window=4", "--max-new-tokens", "24", "--seed", "3",
    "--no-progress",
]  # fmt: skip
# Fields that vary from one run to the next (times, dates, machine, versions, paths), left out of eval records.
EVAL_VOLATILE = (
    "seconds", "per_second", "time", "date", "started", "finished", "machine", "host", "version", "peak_memory",
    "environment", "command", "path", "hostname", "pid", "torch", "transformers", "python", "platform", "cpu",
    "created",
)  # fmt: skip


def eval_cases() -> list[dict]:
    return [dict(kind="eval", id="eval/tiny-llama/grid")]


# Keys left out by exact name: the run's id (and its manifest's) is a hash that covers the environment.
EVAL_VOLATILE_KEYS = ("run", "id")


def _scrub(value):
    if isinstance(value, dict):
        return {
            k: _scrub(v)
            for k, v in value.items()
            if k not in EVAL_VOLATILE_KEYS and not any(word in k.lower() for word in EVAL_VOLATILE)
        }
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def run_eval(case: dict) -> dict:
    from eval.tiny_checkpoint import save_tiny_checkpoint

    checkpoint = _tiny_checkpoint(save_tiny_checkpoint)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "results.jsonl"
        _cli(["eval", "--model", str(checkpoint), *EVAL_ARGS, "--out", str(out)])
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    records = [_scrub(r) for r in records]
    records.sort(
        key=lambda r: json.dumps({k: r.get(k) for k in ("kind", "policy", "budget", "problem_id")}, default=str)
    )
    return {"records": records}


def _tiny_checkpoint(save) -> Path:
    """The tiny checkpoint at one fixed path on every machine (the eval records and their run id name it)."""
    path = Path(tempfile.gettempdir()) / "reasonkv-goldens" / "tiny-llama"
    if not (path / "config.json").is_file():
        staging = Path(tempfile.mkdtemp(dir=path.parent if path.parent.is_dir() else None))
        save(staging / "tiny")
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # another process put it there first: the same files
            (staging / "tiny").rename(path)
    return path


def _cli(argv: list[str]) -> str:
    """Run ``reasonkv ARGV`` in a child process; its standard output (a failure raises with its error)."""
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(ROOT / "src"), "REASONKV_DEBUG": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "reasonkv", *argv], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )
    if done.returncode:
        raise RuntimeError(f"reasonkv {' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


# ---------------------------------------------------------------------------------------------------- help
COMMANDS = ("generate", "policies", "demo", "inspect", "eval", "report", "bench", "calibrate", "lm-eval")


def help_cases() -> list[dict]:
    cases = [dict(kind="help", argv=["--help"])] + [dict(kind="help", argv=[c, "--help"]) for c in COMMANDS]
    cases += [dict(kind="help", module=m) for m in ("reasonkv.cli.equal_bytes", "reasonkv.cli.paired")]
    for case in cases:
        case["id"] = "help/" + (case.get("module") or " ".join(case["argv"]))
    return cases


def run_help(case: dict) -> dict:
    if "module" in case:
        env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run(
            [sys.executable, "-m", case["module"], "--help"], capture_output=True, text=True, env=env, check=False
        )
        return {"text": done.stdout, "code": done.returncode}
    return {"text": _cli(case["argv"])}


# ---------------------------------------------------------------------------------------------------- bench plans
PLAN_ARGS = [
    ["--model", "shape:tiny", "--policies", "h2o,snapkv"],
    ["--model", "shape:tiny", "--policies", "all", "--budget", "64", "--buffer", "16"],
    ["--model", "shape:tiny", "--policies", "h2o,vase-attnv", "--quantized", "64", "--bits", "4"],
    ["--model", "shape:tiny", "--policies", "h2o,streaming", "--allocation", "adaptive", "--ragged",
     "--prefill-to-length", "--batch-sizes", "2,4"],
    ["--model", "shape:tiny", "--policies", "all", "--allocation", "pyramid"],
    ["--model", "shape:tiny", "--policies", "full,h2o,quest", "--compile", "--prefill-to-length",
     "--lengths", "384,448", "--decode-steps", "64", "--budget", "64", "--buffer", "16"],
    ["--model", "shape:tiny", "--policies", "h2o", "--eviction-cost", "--cached", "256"],
    ["--model", "shape:tiny", "--policies", "h2o,snapkv", "--max-batch", "--memory-limit", "1G", "--length", "512"],
    ["--model", "shape:tiny", "--policies", "full,knorm", "--transformers-cache", "--prefill-to-length",
     "--lengths", "512,1024"],
    ["--model", "shape:tiny", "--policies", "snapkv", "-o", "window=8", "-o", "snapkv.kernel=5",
     "--batch-sizes", "1,4"],
]  # fmt: skip


def plan_cases() -> list[dict]:
    return [dict(kind="plan", id="plan/" + " ".join(args), argv=args) for args in PLAN_ARGS]


def run_plan(case: dict) -> dict:
    """The plan ``reasonkv bench ARGV --out ...`` makes, before measuring anything."""
    import argparse

    from reasonkv.bench.plan import build_plan
    from reasonkv.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args([*case["argv"], "--out", "unused"])
        plan = build_plan(bench.settings_from(args))
    except (ValueError, SystemExit) as error:
        return {"refused": type(error).__name__, "message": str(error)}
    specs = {
        mode: {name: None if spec is None else _spec(spec) for name, spec in entries.items()}
        for mode, entries in plan.specs.items()
    }
    return json.loads(
        json.dumps(
            {
                "policies": plan.policies,
                "requested": plan.requested,
                "options": plan.options,
                "instances": {k: None if v is None else v.config() for k, v in plan.instances.items()},
                "specs": specs,
                "tiers": plan.tiers,
                "configs": plan.configs,
                "warnings": plan.warnings,
                "ragged": plan.ragged,
                "compiled": plan.compiled,
                "entries": plan.entries(),
            },
            default=str,
        )
    )


def _spec(spec) -> dict:
    """A CacheSpec as JSON: the policy's configuration and every cache setting."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "policy"}
    allocation = fields.get("allocation")
    if allocation is not None and not isinstance(allocation, str):  # an allocation object: its name
        fields["allocation"] = getattr(allocation, "name", str(allocation))
    return {"policy": spec.policy.config(), **fields}


# ---------------------------------------------------------------------------------------------------- all
RUNNERS = {"decode": run_decode, "trace": run_trace, "eval": run_eval, "help": run_help, "plan": run_plan}


def all_cases() -> list[dict]:
    return decode_cases() + trace_cases() + eval_cases() + help_cases() + plan_cases()


def observe(case: dict) -> dict:
    torch.manual_seed(0)
    return RUNNERS[case["kind"]](case)
