"""Run the fault cases of ``reasonkv eval`` (what the machine or a person does wrong, not a signal) and tabulate
what each did: survived (nothing lost or wrong, and the failure said which file and what to do), lost /
duplicated / wrong (records lost, duplicated or merged wrongly, or a success claimed for records that are not
where it says), or unclear (nothing lost, but the message does not say what failed or how to go on).

Each case runs real ``reasonkv eval`` processes on a tiny random model (saved once) and a 3-problem dataset:
9 units (3 problems x full, streaming at K = 24, and streaming's fidelity replays). Faults strike in the
middle of a run through ``tests/eval/faulty_eval.py`` (a shell command after the N-th record). A full disk is a
small tmpfs in a private mount namespace (``unshare -m``: run as root, or under ``unshare -rm``), a read-only
folder ``chattr +i`` (root) or ``chmod 555``.

    python scripts/fault_cases.py --src src --out fault-table.md        # this checkout
    python scripts/fault_cases.py --src /elsewhere/src --out before.md   # another checkout of reasonkv

Cases a checkout cannot run (an option it lacks) are marked as such. ``--cases third-pass`` runs the nine
findings of the third fault pass instead (``scripts/third_pass_cases.py``: the command line and the Python
API on a tiny model), each *fixed* or *still open* by what a user sees:

    python scripts/fault_cases.py --cases third-pass --out docs/results/faults/third-pass.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import third_pass_cases  # scripts/: the script's own folder is on the path

REPO = Path(__file__).resolve().parents[1]
FAULTY = REPO / "tests" / "eval" / "faulty_eval.py"
sys.path.insert(0, str(REPO / "tests" / "eval"))

SURVIVED, LOST, UNCLEAR = "survived", "lost / duplicated / wrong", "unclear"
GRID = ["--policies", "full,streaming", "--budgets", "24", "--buffer", "4", "--max-new-tokens", "10", "--fidelity"]
UNITS = 9


class Lab:
    """The model, the dataset and a way to run ``reasonkv eval`` with a given source tree."""

    def __init__(self, src: Path, work: Path):
        self.src, self.work = src, work
        self.model = work / "tiny-model"
        if not self.model.exists():
            from tiny_checkpoint import save_tiny_checkpoint

            save_tiny_checkpoint(self.model)
        self.dataset = work / "problems.jsonl"
        problems = [{"id": f"p{i}", "problem": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
        problems[0]["solution"] = "0+0 = \\boxed{0}"
        self.dataset.write_text("".join(json.dumps(p) + "\n" for p in problems), encoding="utf-8")

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.src), "OMP_NUM_THREADS": "1", **extra}

    def command(self, out: Path, *extra: str, dataset: Path | None = None) -> list[str]:
        data = str(dataset or self.dataset)
        return [sys.executable, str(FAULTY), "eval", "--model", str(self.model), "--dataset", data, *GRID,
                "--no-progress", "--out", str(out), *extra]  # fmt: skip

    def eval(self, out: Path, *extra: str, fault: str | None = None, after: int = 3, dataset: Path | None = None):
        env = self.env(**({"FAULT": fault, "FAULT_AFTER": str(after)} if fault else {}))
        done = subprocess.run(self.command(out, *extra, dataset=dataset), env=env, capture_output=True, text=True)
        return done.returncode, _last_lines(done.stderr)

    def torchrun(self, out: Path, fault: str | None = None, after: int = 2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "localhost:0", *self.command(out)[1:]]  # fmt: skip
        env = self.env(**({"FAULT": fault, "FAULT_AFTER": str(after), "FAULT_RANK": "0"} if fault else {}))
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        return done.returncode, _last_lines(done.stderr)


def _last_lines(text: str) -> str:
    """What the process said, without progress bars."""
    return "\n".join(line for line in text.splitlines() if line.strip() and "Loading weights" not in line)


def records(path: Path) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            out.append({"kind": "<not json>"})
    return out


def units(path: Path) -> Counter:
    """Unit -> how often it is in ``path`` (a unit: kind, problem, policy, budget, sample)."""
    found = Counter()
    for r in records(path):
        if r.get("kind") in ("generation", "fidelity"):
            found[(r["kind"], r.get("problem_id"), r.get("policy"), r.get("budget"), r.get("sample"))] += 1
    return found


def complete(path: Path) -> bool:
    found = units(path)
    return len(found) == UNITS and max(found.values()) == 1


def _one_line(text: str) -> str:
    return " ".join(text.split())[-220:]


# ---------------------------------------------------------------------------------- the cases


def output_folder_removed(lab: Lab, tmp: Path):
    out = tmp / "D" / "r.jsonl"
    rc, err = lab.eval(out, fault=f"rm -rf {tmp / 'D'}")
    if rc == 0:
        return LOST, f"exit 0, a success printed for records that are gone: {_one_line(err)}"
    return (SURVIVED if str(out) in err and "removed" in err else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def output_file_removed(lab: Lab, tmp: Path):
    out = tmp / "D" / "r.jsonl"
    rc, err = lab.eval(out, fault=f"rm {out}")
    headless = out.exists() and records(out)[:1] and records(out)[0].get("kind") != "manifest"
    if rc == 0 or headless:
        return LOST, f"exit {rc}{', a new file without its manifest' if headless else ''}: {_one_line(err)}"
    return (SURVIVED if str(out) in err and "removed" in err else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def output_folder_renamed(lab: Lab, tmp: Path):
    out = tmp / "D" / "r.jsonl"
    rc, err = lab.eval(out, fault=f"mv {tmp / 'D'} {tmp / 'D_moved'}")
    if rc == 0:
        return LOST, f"exit 0, the summary names {out}, which does not exist: {_one_line(err)}"
    (tmp / "D_moved").rename(tmp / "D")
    rc2, err2 = lab.eval(out)
    ok = "D_moved" in err and rc2 == 0 and complete(out)
    return (SURVIVED if ok else UNCLEAR), f"exit {rc}: {_one_line(err)}; moved back and rerun: exit {rc2}, " + (
        f"{len(units(out))}/{UNITS} units once" if complete(out) else "incomplete"
    )


def output_folder_renamed_torchrun(lab: Lab, tmp: Path):
    out = tmp / "D" / "r.jsonl"
    rc, err = lab.torchrun(out, fault=f"mv {tmp / 'D'} {tmp / 'D_moved'}")
    if rc == 0:
        return LOST, f"exit 0, never merged: {_one_line(err)}"
    return (SURVIVED if "D_moved" in err else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def foreign_shard(lab: Lab, tmp: Path):
    out = tmp / "r.jsonl"
    rc, _ = lab.eval(out)
    other = tmp / "other.jsonl"
    lab.eval(other, "--policies", "full,h2o", "--shard", "0/2")
    foreign = tmp / "r.shard-0-of-2.jsonl"
    (tmp / "other.shard-0-of-2.jsonl").rename(foreign)
    before = foreign.read_bytes()
    rc, err = lab.eval(out)
    h2o = [r for r in records(out) if r.get("policy") == "h2o"]
    if h2o or not foreign.exists():
        fate = "deleted" if not foreign.exists() else "kept"
        return LOST, f"exit {rc}; {len(h2o)} h2o records merged into --out, the shard file {fate}"
    ok = foreign.read_bytes() == before and "another grid" in err
    return (SURVIVED if ok else UNCLEAR), f"exit {rc}: {_one_line(err)}"


_FULL = """
set -u
mount -t tmpfs -o size=1m tmpfs "$D"
{body}
"""


def _full_disk(lab: Lab, tmp: Path, body: str) -> Path:
    logs = tmp / "logs"
    logs.mkdir()
    (tmp / "D").mkdir()
    script = _FULL.format(body=body)
    env = lab.env(D=str(tmp / "D"), LOGS=str(logs), CMD=" ".join(lab.command(tmp / "D" / "r.jsonl")))
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    subprocess.run([*unshare, "sh", "-c", script], env=env, check=True)
    return logs


def _log(logs: Path, name: str) -> tuple[int, str]:
    return int((logs / f"{name}.rc").read_text()), _last_lines((logs / name).read_text())


def disk_full_mid_run(lab: Lab, tmp: Path):
    logs = _full_disk(
        lab,
        tmp,
        """
FAULT="head -c 4000000 /dev/zero > $D/filler || true" FAULT_AFTER=3 $CMD > $LOGS/a 2>&1; echo $? > $LOGS/a.rc
cp $D/r.jsonl $LOGS/a.jsonl; rm $D/filler
$CMD > $LOGS/b 2>&1; echo $? > $LOGS/b.rc; cp $D/r.jsonl $LOGS/b.jsonl; ls -A $D > $LOGS/listing
""",
    )
    (rc, err), (rc2, _) = _log(logs, "a"), _log(logs, "b")
    resumed = complete(logs / "b.jsonl")
    if rc == 0 or not resumed:
        found = len(units(logs / "b.jsonl"))
        return LOST, f"exit {rc}: {_one_line(err)}; after freeing space: exit {rc2}, resumed {found}/{UNITS}"
    said = "r.jsonl" in err and "safe" in err and "rerun" in err
    left = (logs / "listing").read_text().split()
    return (SURVIVED if said else UNCLEAR), f"exit {rc}: {_one_line(err)}; freed: resumed {UNITS}/{UNITS}; left {left}"


def disk_full_during_merge(lab: Lab, tmp: Path):
    logs = _full_disk(
        lab,
        tmp,
        """
$CMD --shard 0/2 > $LOGS/s0 2>&1; echo $? > $LOGS/s0.rc
export FAULT="head -c 4000000 /dev/zero > $D/filler || true" FAULT_AFTER=7  # past shard 1's own records
$CMD --shard 1/2 > $LOGS/a 2>&1; echo $? > $LOGS/a.rc; unset FAULT FAULT_AFTER
ls -A $D > $LOGS/listing-full; rm $D/filler
$CMD > $LOGS/b 2>&1; echo $? > $LOGS/b.rc; cp $D/r.jsonl $LOGS/b.jsonl
""",
    )
    (rc, err), (rc2, _) = _log(logs, "a"), _log(logs, "b")
    resumed = complete(logs / "b.jsonl")
    if not resumed:
        return LOST, f"exit {rc}: {_one_line(err)}; freed: exit {rc2}, {len(units(logs / 'b.jsonl'))}/{UNITS} units"
    said = rc != 0 and "merg" in err and "rerun" in err
    return (SURVIVED if said else UNCLEAR), f"exit {rc}: {_one_line(err)}; freed: merged {UNITS}/{UNITS}"


def disk_full_on_resume(lab: Lab, tmp: Path):
    logs = _full_disk(
        lab,
        tmp,
        """
FAULT="head -c 4000000 /dev/zero > $D/filler || true" FAULT_AFTER=3 $CMD > $LOGS/a 2>&1; echo $? > $LOGS/a.rc
$CMD > $LOGS/b 2>&1; echo $? > $LOGS/b.rc; ls -A $D > $LOGS/listing
""",
    )
    rc, err = _log(logs, "b")
    said = rc != 0 and ("free" in err or "space" in err) and "r.jsonl" in err and "rerun" in err
    return (SURVIVED if said else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def _read_only(folder: Path):
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(folder)], check=True)
        return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o555)
    return lambda: folder.chmod(0o755)


def read_only_after_the_work(lab: Lab, tmp: Path):
    folder = tmp / "D"
    rc, err = lab.eval(folder / "r.jsonl", fault=f"chattr +i {folder} || chmod 555 {folder}", after=UNITS)
    subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)
    if not complete(folder / "r.jsonl"):
        return LOST, f"exit {rc}: {_one_line(err)}"
    return (SURVIVED if rc == 0 else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def _edited(lab: Lab, tmp: Path, edit) -> tuple[int, str, Path, bytes]:
    out = tmp / "r.jsonl"
    lab.eval(out)
    lines = out.read_text(encoding="utf-8").splitlines()
    lines = edit(lines)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    before = out.read_bytes()
    rc, err = lab.eval(out)
    return rc, err, out, before


def _manifest_edit(field: str, value):
    def edit(lines):
        first = json.loads(lines[0])
        first[field] = value
        return [json.dumps(first), *lines[1:]]

    return edit


def _judge_edit(rc, err, out, before, field: str):
    if "Traceback (most recent call last)" in err:
        return UNCLEAR, f"exit {rc}, a Python traceback: {_one_line(err)}"
    if out.read_bytes() != before and rc == 0:
        return UNCLEAR, f"exit {rc}, accepted: {_one_line(err)}"
    named = "line" in err and field in err
    return (SURVIVED if named else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def manifest_setup_null(lab, tmp):
    return _judge_edit(*_edited(lab, tmp, _manifest_edit("setup", None)), "setup")


def manifest_grid_null(lab, tmp):
    return _judge_edit(*_edited(lab, tmp, _manifest_edit("grid", None)), "grid")


def manifest_environment_string(lab, tmp):
    return _judge_edit(*_edited(lab, tmp, _manifest_edit("environment", "x")), "environment")


def manifest_launch_null(lab, tmp):
    return _judge_edit(*_edited(lab, tmp, _manifest_edit("launch", None)), "launch")


def record_budget_object(lab, tmp):
    def edit(lines):
        index = next(i for i, line in enumerate(lines) if json.loads(line).get("policy") == "streaming")
        record = json.loads(lines[index])
        record["budget"] = {}
        lines[index] = json.dumps(record)
        return lines

    return _judge_edit(*_edited(lab, tmp, edit), "budget")


def garbage_line(lab, tmp):
    rc, err, out, _ = _edited(lab, tmp, lambda lines: [lines[0], "garbage", *lines[1:]])
    if "line 2" not in err:
        return UNCLEAR, f"exit {rc}: {_one_line(err)}"
    if "--repair" not in err:
        return UNCLEAR, f"exit {rc}, no repair offered (only another --out): {_one_line(err)}"
    rc2, err2 = lab.eval(out, "--repair")
    ok = rc2 == 0 and complete(out) and list(tmp.glob("r.jsonl.rejected-*"))
    return (
        SURVIVED if ok else UNCLEAR
    ), f"exit {rc}: {_one_line(err)}; --repair: exit {rc2}, {len(units(out))}/{UNITS}"


def manifest_edited(lab, tmp):
    rc, err, out, before = _edited(
        lab, tmp, lambda lines: [lines[0].replace('"torch": "', '"torch": "0.0-'), *lines[1:]]
    )
    if rc == 0 and "manifest is added" in err and out.read_bytes() == before:
        return UNCLEAR, f"exit 0, says the manifest is added, nothing added: {_one_line(err)}"
    return (SURVIVED if "edited" in err else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def dataset_not_utf8(lab, tmp):
    data = tmp / "latin1.jsonl"
    data.write_bytes(lab.dataset.read_text(encoding="utf-8").replace("What", "Wh\u00e4t").encode("latin-1"))
    rc, err = lab.eval(tmp / "r.jsonl", dataset=data)
    return (SURVIVED if str(data) in err and "line 1" in err else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def dataset_bom(lab, tmp):
    data = tmp / "bom.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + lab.dataset.read_bytes())
    rc, err = lab.eval(tmp / "r.jsonl", dataset=data)
    return (SURVIVED if rc == 0 and complete(tmp / "r.jsonl") else UNCLEAR), f"exit {rc}: {_one_line(err)}"


def prompt_beyond_context(lab, tmp):
    data = tmp / "long.jsonl"
    rows = [json.loads(line) for line in lab.dataset.read_text().splitlines()]
    rows[2]["problem"] = "Add: " + "1+" * 1500 + "1"  # 3,000+ tokens; the model's context is 1,024
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    start = time.monotonic()
    rc, err = lab.eval(tmp / "r.jsonl", dataset=data)
    seconds = time.monotonic() - start
    errors = [r for r in records(tmp / "r.jsonl") if r.get("kind") == "error"]
    said = errors and all("context" in r["error"] for r in errors)
    detail = f"exit {rc} after {seconds:.0f} s, {len(errors)} error records" + (
        f": {errors[0]['error'][:120]}" if errors else ""
    )
    return (SURVIVED if said else UNCLEAR), detail


_KILL_AT_LINK = """
import os, sys
try:
    from reasonkv.runs import outputs
except ImportError:  # older layouts
    from reasonkv import outputs
outputs.os.link = lambda *args: os._exit(9)  # killed once the temporary file is written, before it is linked
from reasonkv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def killed_while_creating(lab, tmp):
    out = tmp / "r.jsonl"
    argv = lab.command(out)[2:]  # eval ...
    done = subprocess.run([sys.executable, "-c", _KILL_AT_LINK, *argv], env=lab.env(), capture_output=True, text=True)
    if done.returncode != 9:
        return UNCLEAR, f"could not kill the process while it created --out: {_one_line(done.stderr)}"
    stale = [p.name for p in tmp.iterdir() if p.name.startswith(".r.jsonl.")]
    rc, err = lab.eval(out)
    left = [p.name for p in tmp.iterdir() if p.name.startswith(".r.jsonl.")]
    ok = rc == 0 and complete(out) and not left
    return (
        SURVIVED if ok else UNCLEAR
    ), f"killed: temporary files {stale}; rerun exit {rc}, temporary files left {left}"


def killed_at_random(lab, tmp):
    out = tmp / "r.jsonl"
    for after in (1, 4, 8):
        lab.eval(out, fault="kill -9 $PPID", after=after)
    rc, err = lab.eval(out)
    found = units(out)
    results = f"{len(found)}/{UNITS} units, the most copies of one {max(found.values()) if found else 0}"
    return (
        SURVIVED if rc == 0 and complete(out) else LOST
    ), f"3 SIGKILLs (after records 1, 4, 8), rerun exit {rc}: {results}"


CASES = {
    "1. --out's folder removed mid-run (rm -rf D)": output_folder_removed,
    "1. --out removed mid-run (rm D/r.jsonl)": output_file_removed,
    "2. --out's folder renamed mid-run": output_folder_renamed,
    "2. --out's folder renamed mid-run, torchrun 2 ranks": output_folder_renamed_torchrun,
    "3. a shard file of another grid beside a complete --out": foreign_shard,
    "4. disk full mid-run, then space freed": disk_full_mid_run,
    "4. disk full during the merge, then space freed": disk_full_during_merge,
    "4. resuming while the disk is still full": disk_full_on_resume,
    "5. folder made read-only after the last record": read_only_after_the_work,
    '6. manifest "setup": null': manifest_setup_null,
    '6. manifest "grid": null': manifest_grid_null,
    '6. manifest "environment": "x"': manifest_environment_string,
    '6. manifest "launch": null': manifest_launch_null,
    '6. a record with "budget": {}': record_budget_object,
    "6. a garbage line (and the repair)": garbage_line,
    "7. a dataset that is not UTF-8": dataset_not_utf8,
    "7. a dataset with a UTF-8 byte-order mark": dataset_bom,
    "8. a manifest edited by hand (environment)": manifest_edited,
    "10. a problem beyond the model's context": prompt_beyond_context,
    "11. killed while --out is first created": killed_while_creating,
    "(kept) SIGKILL mid-run three times, then resumed": killed_at_random,
}


SUITES = {
    "eval": (CASES, (SURVIVED, LOST, UNCLEAR)),
    "third-pass": (third_pass_cases.CASES, (third_pass_cases.FIXED, third_pass_cases.OPEN)),
}


def _shown(src: Path) -> str:
    """The sources as the table names them: inside this checkout relative to it, never the machine's folders."""
    return os.path.relpath(src, REPO) if src.is_relative_to(REPO) else src.name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the reasonkv sources to run")
    parser.add_argument("--out", type=Path, required=True, help="the markdown table to write")
    parser.add_argument(
        "--cases",
        choices=SUITES,
        default="eval",
        help="eval: the faults of reasonkv eval (default); third-pass: the nine findings of issue 49",
    )
    parser.add_argument("--only", default=None, help="run the cases whose name holds this text")
    args = parser.parse_args()
    cases, outcomes = SUITES[args.cases]
    work = Path(tempfile.mkdtemp(prefix="fault-cases-"))
    lab = Lab(args.src.resolve(), work)
    rows = []
    for name, case in cases.items():
        if args.only and args.only not in name:
            continue
        tmp = work / f"case-{len(rows)}"
        tmp.mkdir()
        try:
            outcome, detail = case(lab, tmp)
        except Exception as error:  # noqa: BLE001 - a case that cannot run on this checkout is reported, not fatal
            outcome, detail = "could not run", f"{type(error).__name__}: {error}"
        finally:
            subprocess.run(["chattr", "-R", "-i", str(tmp)], capture_output=True)
        detail = detail.replace(str(work), "<cases>").replace(str(lab.src), "<src>").replace("|", "/")
        rows.append((name, outcome, detail))
        print(f"{name}: {outcome}: {detail}", file=sys.stderr, flush=True)
    counts = Counter(outcome for _, outcome, _ in rows)
    lines = [f"sources: {_shown(lab.src)}", "", "| case | outcome | what happened |", "|---|---|---|"]
    lines += [f"| {name} | {outcome} | {detail} |" for name, outcome, detail in rows]
    lines += ["", f"tried {len(rows)}: " + ", ".join(f"{counts[k]} {k}" for k in (*outcomes, "could not run"))]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
