"""The nine findings of the third fault pass (issue 49), each tried as a user would: the real command line or
Python API on a tiny model, and judged by what the user sees: *fixed* or *still open*.

Run through ``scripts/fault_cases.py --cases third-pass``, which gives each case a lab (``lab.src``: the
sources to run, ``lab.model``: a tiny Llama checkpoint, ``lab.dataset``: 3 problems, ``lab.env()``) and an
empty folder of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FIXED, OPEN = "fixed", "still open"
TESTS = Path(__file__).resolve().parents[1] / "tests" / "eval"  # tiny_checkpoint.py
# torch's own words, which tell a user nothing about a gate file (and one of them is unsafe advice)
TORCH_TEXT = ("weights_only", "Errno", "PytorchStreamReader", "miniz", "Traceback")


def reasonkv(lab, *args) -> tuple[int, str]:
    """``reasonkv ARGS`` as a user runs it: its exit status and everything it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "reasonkv", *map(str, args)], env=lab.env(), capture_output=True, text=True
    )
    return done.returncode, _unplaced(lab, done.stdout + done.stderr)


def python(lab, program: str, *args, **env: str) -> tuple[int, str, str]:
    """A Python program against the sources: exit status, standard output, standard error."""
    done = subprocess.run(
        [sys.executable, "-c", program, *map(str, args)], env=lab.env(**env), capture_output=True, text=True
    )
    return done.returncode, done.stdout, _unplaced(lab, done.stderr)


def _unplaced(lab, text: str) -> str:
    """What a command printed, this machine's folders named by their role (the table is committed)."""
    return text.replace(str(lab.work), "<cases>").replace(str(lab.src), "<src>")


def _said(text: str) -> str:
    """The last thing printed (the error or the summary), on one line, without progress bars."""
    lines = [line.split("\r")[-1] for line in text.splitlines()]
    lines = [line.rsplit("]", 1)[-1] if "it/s]" in line or "s/it]" in line else line for line in lines]  # tqdm
    lines = [line.strip() for line in lines]
    return " ".join(line for line in lines if line)[-260:]


# ---------------------------------------------------------------------------------- calibrate --gates

GATES = ["--gate-traces", "2", "--held-out", "1", "--max-new-tokens", "16", "--gate-steps", "2", "--no-progress"]


def gates_overwrite_a_users_file(lab, tmp: Path):
    """1. ``calibrate --gates --out F`` where F holds the user's own gates.json."""
    folder = tmp / "gout"
    folder.mkdir()
    (folder / "gates.json").write_text("mine\n", encoding="utf-8")
    (folder / "notes.txt").write_text("notes\n", encoding="utf-8")
    rc, text = reasonkv(lab, "calibrate", "--model", lab.model, "--gates", *GATES, "--out", folder)
    kept = (folder / "gates.json").read_text(encoding="utf-8") == "mine\n"
    if not kept:
        return OPEN, f"exit {rc}, the user's gates.json replaced without a word: {_said(text)}"
    if rc != 0 and "gates.json" in text and "Traceback" not in text:
        return FIXED, f"exit {rc}, gates.json kept: {_said(text)}"
    return OPEN, f"exit {rc}, gates.json kept but the message does not name it: {_said(text)}"


def gates_trained_on_nothing(lab, tmp: Path):
    """2. A gate trained on sequences too short for its blocks (no query has a whole block before it to choose):
    160-token blocks on traces of 207 to 384 tokens (the bundled SmolLM2 does the same at 16 new tokens in
    64-token blocks). Where answers are packed into longer sequences (``--gate-pack``), a pack under two blocks."""
    folder = tmp / "short"
    short = ["--block-size", "160"]
    rc, text = reasonkv(
        lab, "calibrate", "--model", lab.model, "--gates", *GATES, *short, "--gate-pack", "200", "--out", folder
    )
    if "unrecognized arguments: --gate-pack" in text:  # a checkout from before packing
        rc, text = reasonkv(lab, "calibrate", "--model", lab.model, "--gates", *GATES, *short, "--out", folder)
    if (folder / "gates.pt").exists():
        return OPEN, f"exit {rc}, gates.pt written: {_said(text)}"
    if rc != 0 and "Traceback" not in text:
        return FIXED, f"exit {rc}, no gate written: {_said(text)}"
    return OPEN, f"exit {rc}, no gate written, but no clear refusal either: {_said(text)}"


# ---------------------------------------------------------------------------------- report


def record_outside_the_grid(lab, tmp: Path):
    """3. One record of a 3-problem run moved to a problem the run never had, then ``reasonkv report``."""
    out = tmp / "r.jsonl"
    grid = ["--policies", "full,h2o", "--budgets", "24", "--buffer", "4", "--max-new-tokens", "10", "--no-progress"]
    rc, text = reasonkv(lab, "eval", "--model", lab.model, "--dataset", lab.dataset, *grid, "--out", out)
    if rc != 0:
        raise RuntimeError(f"the run to edit failed: {_said(text)}")
    lines = out.read_text(encoding="utf-8").splitlines()
    index = next(i for i, line in enumerate(lines) if json.loads(line).get("policy") == "h2o")
    record = json.loads(lines[index])
    record["problem_id"] = "p7"
    lines[index] = json.dumps(record)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc, text = reasonkv(lab, "report", out, "--out", tmp / "report", "--quiet")
    if rc == 0:
        return OPEN, "exit 0, the record of problem p7 (not in the run) accepted and reported"
    named = "p7" in text or "problem" in text
    return (FIXED if named else OPEN), f"exit {rc}: {_said(text)}"


# ---------------------------------------------------------------------------------- settings


def setting_that_does_not_apply(lab, tmp: Path):
    """4. ``--allocation pyramid --adaptive-alpha 0.5``: alpha belongs to ``adaptive``; generate and bench."""
    allocation = ["--allocation", "pyramid", "--adaptive-alpha", "0.5"]
    runs = {
        "generate": reasonkv(
            lab,
            "generate",
            "--model",
            lab.model,
            "--prompt",
            "What is 1+1?",
            "--policy",
            "h2o",
            "--budget",
            "24",
            "--buffer",
            "4",
            *allocation,
            "--max-new-tokens",
            "8",
        ),  # fmt: skip
        "bench": reasonkv(
            lab,
            "bench",
            "--model",
            "shape:tiny",
            "--dtype",
            "fp32",
            "--policies",
            "h2o",
            *allocation,
            "--lengths",
            "64",
            "--budget",
            "32",
            "--buffer",
            "16",
            "--prompt-length",
            "16",
            "--rounds",
            "1",
            "--no-plots",
            "--no-progress",
            "--out",
            tmp / "bench",
        ),  # fmt: skip
    }
    ran = [name for name, (rc, _) in runs.items() if rc == 0]
    unclear = [name for name, (rc, text) in runs.items() if rc != 0 and "alpha" not in text]
    said = "; ".join(f"{name}: exit {rc}: {_said(text)[-140:]}" for name, (rc, text) in runs.items())
    if ran or unclear:
        what = f"ran with alpha ignored: {', '.join(ran)}" if ran else f"refused without naming alpha: {unclear}"
        return OPEN, f"{what}; {said}"
    return FIXED, said


# ---------------------------------------------------------------------------------- bench.json


def machine_paths_in_bench_json(lab, tmp: Path):
    """5. ``reasonkv bench --out /absolute/folder``: bench.json and bench.md are committed and read elsewhere."""
    out = tmp / "bench"
    rc, text = reasonkv(
        lab, "bench", "--model", "shape:tiny", "--dtype", "fp32", "--policies", "streaming", "--lengths", "64",
        "--budget", "32", "--buffer", "16", "--prompt-length", "16", "--rounds", "1", "--no-plots", "--no-progress",
        "--out", out,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the bench failed: {_said(text)}")
    machine = [str(tmp), str(lab.src), os.path.dirname(sys.executable)]
    found = sorted(
        {
            f"{name}: {path}"
            for name in ("bench.json", "bench.md")
            for path in machine
            if path in (out / name).read_text()
        }
    )
    argv = json.loads((out / "bench.json").read_text()).get("argv") or [""]
    if found:
        return OPEN, f"machine paths recorded ({'; '.join(found)}); argv starts {argv[0]!r}"
    return FIXED, f"no machine path in bench.json or bench.md; argv starts {argv[0]!r}"


# ---------------------------------------------------------------------------------- inspect


def inspect_into_an_unwritable_folder(lab, tmp: Path):
    """6. ``reasonkv inspect --out /sys/page.html``: the folder exists and nobody may write in it."""
    rc, text = reasonkv(
        lab, "inspect", "--model", lab.model, "--prompt", "What is 1+1?", "--policies", "h2o", "--budget", "24",
        "--buffer", "4", "--max-new-tokens", "40", "--out", "/sys/page.html",
    )  # fmt: skip
    decoded = "decoding" in text or " tokens (" in text
    if rc == 0:
        return OPEN, f"exit 0: {_said(text)}"
    if decoded or "/sys" not in text or "Traceback" in text:
        return OPEN, f"exit {rc}{' after decoding' if decoded else ''}: {_said(text)}"
    return FIXED, f"exit {rc} before decoding: {_said(text)}"


# ---------------------------------------------------------------------------------- gate files


def damaged_gate_files(lab, tmp: Path):
    """7. A gate file cut short and a text file, given to the seer policy as ``-o gates=PATH``: the message names
    the file, what it is (text; truncated or damaged) and what was expected (a gate file), in its own words."""
    shipped = (lab.src / "reasonkv" / "data" / "gates" / "smollm2-135m.pt").read_bytes()
    files = {"truncated": tmp / "gates-truncated.pt", "text": tmp / "gates-text.pt"}
    files["truncated"].write_bytes(shipped[: len(shipped) // 2])
    files["text"].write_text("these are not gates\n", encoding="utf-8")
    what = {"truncated": ("truncated", "cut short", "incomplete", "damaged", "corrupt"), "text": ("text",)}
    said, bad = [], []
    for kind, path in files.items():
        rc, text = reasonkv(
            lab, "generate", "--model", lab.model, "--prompt", "What is 1+1?", "--policy", "seer", "--budget", "128",
            "-o", f"gates={path}", "--max-new-tokens", "8",
        )  # fmt: skip
        leaked = [word for word in TORCH_TEXT if word in text]
        if rc == 0 or leaked:
            bad.append(f"{kind}: " + (f"torch's own words ({', '.join(leaked)})" if leaked else "exit 0"))
        elif path.name not in text or "gate" not in text or not any(word in text for word in what[kind]):
            bad.append(f"{kind}: the message does not name the file, say it is {what[kind][0]}, or expect a gate")
        said.append(f"{kind}: exit {rc}: {_said(text)[-150:]}")
    return (OPEN if bad else FIXED), ("; ".join(bad) + " -- " if bad else "") + "; ".join(said)


# ---------------------------------------------------------------------------------- converted weights

_CONVERTED = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tiny_checkpoint import save_tiny_checkpoint
from reasonkv.models import bundled, load_model
stand_in = Path(sys.argv[2])
stand_in.write_bytes(b"GGUF stands in for the bundled file")
bundled._packaged_file = lambda model: stand_in  # the bundled model's conversion, made fast by a tiny model
bundled._convert_gguf_checkpoint = lambda source, out_dir: save_tiny_checkpoint(out_dir)
load_model("default")
"""


def converted_weights_changed_in_place(lab, tmp: Path):
    """8. A bit of the converted model.safetensors flipped in place, its size and modification time kept, then
    the model loaded again (the bundled model's conversion stands in for by a tiny checkpoint)."""
    cache = {"REASONKV_CACHE_DIR": str(tmp / "cache")}
    rc, _, err = python(lab, _CONVERTED, TESTS, tmp / "stand-in.gguf", **cache)
    weights = sorted((tmp / "cache").glob("models/*/model.safetensors"))
    if rc != 0 or not weights:
        raise RuntimeError(f"the first load made no copy: {_said(err)}")
    before = weights[0].stat()
    data = bytearray(weights[0].read_bytes())
    data[-7] ^= 0x01  # one bit of the last weight: still finite
    weights[0].write_bytes(bytes(data))
    os.utime(weights[0], ns=(before.st_atime_ns, before.st_mtime_ns))
    rc, _, err = python(lab, _CONVERTED, TESTS, tmp / "stand-in.gguf", **cache)
    if "model.safetensors" not in err:
        return OPEN, f"exit {rc}, loaded the changed weights without a word about them"
    return FIXED, f"exit {rc}: {_said(err)}"


# ---------------------------------------------------------------------------------- the API past the context

_PAST_CONTEXT = """
import json, warnings
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import reasonkv
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=32)
model = LlamaForCausalLM(config).eval()
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["inside"] = reasonkv.generate(model, None, [[1, 2, 3, 4]], max_new_tokens=8, ignore_eos=True)[0].stats
    try:
        out["past"] = reasonkv.generate(model, None, [[1, 2, 3, 4]], max_new_tokens=48, ignore_eos=True)[0].stats
    except Exception as error:
        out["refused"] = f"{type(error).__name__}: {error}"
out["warnings"] = [str(w.message) for w in caught if "context" in str(w.message)]
lines, inside = [], False
for line in (reasonkv.generate.__doc__ or "").splitlines():
    if line.startswith("    ") and not line.startswith("     "):  # a parameter's name line
        inside = "max_new_tokens" in line
    elif inside:
        lines.append(line.strip())
out["doc"] = " ".join(lines)
print(json.dumps(out, default=str))
"""


def api_past_the_context(lab, tmp: Path):
    """9. ``reasonkv.generate`` 4 + 48 tokens on a model of 32 positions: the command line refuses this."""
    rc, out, err = python(lab, _PAST_CONTEXT)
    if rc != 0:
        raise RuntimeError(_said(err))
    seen = json.loads(out)
    if "refused" in seen:
        return FIXED, f"refused, as the command line does: {seen['refused'][:200]}"
    inside, past = seen["inside"], seen["past"]
    recorded = {k: past[k] for k in past if "context" in k and past[k] != inside.get(k)}
    documented = "context" in seen["doc"]
    what = (
        f"warned: {bool(seen['warnings'])}; the stats record it: {recorded or 'no'}; "
        f"max_new_tokens documents it: {'yes' if documented else 'no'}"
    )
    return (FIXED if recorded and documented else OPEN), what


CASES = {
    "1. calibrate --gates into a folder with the user's gates.json": gates_overwrite_a_users_file,
    "2. calibrate --gates on traces with no complete block": gates_trained_on_nothing,
    "3. a record of a problem outside the run, then report": record_outside_the_grid,
    "4. --allocation pyramid --adaptive-alpha 0.5 (generate, bench)": setting_that_does_not_apply,
    "5. machine paths in bench.json": machine_paths_in_bench_json,
    "6. inspect --out /sys/page.html (a folder nobody may write)": inspect_into_an_unwritable_folder,
    "7. a damaged gate file (cut short; a text file)": damaged_gate_files,
    "8. converted weights changed in place, size and time kept": converted_weights_changed_in_place,
    "9. the Python API decoding past the model's context": api_past_the_context,
}
