"""The sandbox's ranges for timeout and memory, its cgroup discovery, and the supervisor's memory watch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from reasonkv.cli.args import code_memory_argument, code_timeout_argument
from reasonkv.eval.grid import CodeSettings
from reasonkv.sandbox.cgroup import RunGroup, find_parent
from reasonkv.sandbox.limits import MAX_TIMEOUT, check_memory, check_timeout, machine_memory_mb
from reasonkv.sandbox.supervise import supervise


def test_ranges_accept_their_bounds_and_name_what_is_refused():
    assert check_timeout(MAX_TIMEOUT) == MAX_TIMEOUT and check_timeout(1) == 1.0
    assert check_memory(64) == 64 and check_memory(machine_memory_mb()) == machine_memory_mb()
    for bad in (0, -1, 1e7, float("nan"), True, "6"):
        with pytest.raises(ValueError, match=r"in \(0, 3600\], got "):
            check_timeout(bad)
    for bad in (63, machine_memory_mb() + 1, 2**70, 256.0, True):
        with pytest.raises(ValueError, match=rf"from 64 to {machine_memory_mb()} .*got {bad!r}$"):
            check_memory(bad)


def test_the_cli_refuses_out_of_range_values_before_anything_runs():
    assert code_timeout_argument("2.5") == 2.5 and code_memory_argument("512") == 512
    for function, text, message in [
        (code_timeout_argument, "1e7", r"--code-timeout must be a number of seconds in \(0, 3600\], got 10000000.0"),
        (code_timeout_argument, "soon", "--code-timeout .* got 'soon'"),
        (code_memory_argument, "1e9", "--code-memory must be an integer number of MiB from 64 to .* got '1e9'"),
        (code_memory_argument, "32", "from 64 to .* got 32"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            function(text)


def test_the_python_api_refuses_them_too():
    with pytest.raises(ValueError, match=r"code timeout must be a number of seconds in \(0, 3600\], got 10000000.0"):
        CodeSettings.build(timeout=1e7)
    with pytest.raises(ValueError, match="code memory_mb must be an integer number of MiB from 64"):
        CodeSettings.build(memory_mb=10**9)


def _fake_hierarchy(root: Path, *, handed: str) -> tuple[str, str]:
    """A cgroup2-like folder tree (plain files): the mountinfo and /proc/self/cgroup text that point at it."""
    own = root / "session.scope"
    own.mkdir()
    for folder in (root, own):
        (folder / "cgroup.controllers").write_text("cpu memory pids\n")
        (folder / "cgroup.subtree_control").write_text("")
    (own / "cgroup.subtree_control").write_text(handed)
    mountinfo = f"30 22 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw\n"
    return mountinfo, "0::/session.scope\n"


def test_a_group_is_made_only_where_memory_and_pids_are_handed_down(tmp_path):
    no_cgroup2 = "22 1 0:21 / /sys rw - sysfs sysfs rw\n"
    assert find_parent(no_cgroup2, "0::/\n") == (None, "no cgroup2 file system is mounted")
    mountinfo, cgroups = _fake_hierarchy(tmp_path, handed="memory\n")
    parent, why = find_parent(mountinfo, cgroups)
    assert parent is None
    assert f"{tmp_path / 'session.scope'} hands down no pids controller" in why
    assert f"{tmp_path} hands down no memory/pids controller" in why  # the mount's root is tried too
    (tmp_path / "session.scope" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    parent, why = find_parent(mountinfo, cgroups)
    assert (parent, why) == (tmp_path / "session.scope", "")
    # On plain files the group cannot be removed by the kernel: what create writes is what a cgroup needs.
    group = RunGroup.create(parent, memory_mb=256, processes=34)
    written = {name: (group.path / name).read_text() for name in ("memory.max", "memory.oom.group", "pids.max")}
    assert written == {"memory.max": str(256 * 2**20), "memory.oom.group": "1", "pids.max": "34"}
    assert not group.oom_killed()
    (group.path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert group.oom_killed()


def test_this_machine_says_why_no_cgroup_limits_a_run_or_makes_one():
    parent, why = find_parent()
    assert (parent is None) == bool(why)
    if parent is not None:
        group = RunGroup.create(parent, memory_mb=64, processes=4)
        assert group.members() == [] and group.remove() and not group.path.exists()


def test_the_watch_kills_the_run_when_it_says_so():
    looks = []

    def watch() -> bool:
        looks.append(1)
        return len(looks) >= 3

    program = [sys.executable, "-c", "import time\ntime.sleep(30)\n"]
    finished = supervise(program, stdin_fd=0, timeout=20, output_limit=1024, watch=watch)
    assert finished.over_memory and not finished.timed_out and finished.returncode == -9
    assert len(looks) == 3 and finished.seconds < 5
    # Also once the program closed its output (the watch keeps looking while it waits).
    looks.clear()
    program = [sys.executable, "-c", "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)\n"]
    finished = supervise(program, stdin_fd=0, timeout=20, output_limit=1024, watch=watch)
    assert finished.over_memory and finished.returncode == -9 and finished.seconds < 5


def test_reasonkv_eval_refuses_them_while_parsing(capsys):
    from reasonkv.cli.main import build_parser

    parser = build_parser()
    for flag, value, message in [
        ("--code-timeout", "1e7", r"--code-timeout must be a number of seconds in (0, 3600], got 10000000.0"),
        ("--code-memory", "16", "--code-memory must be an integer number of MiB from 64 to"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["eval", "--dataset", "humaneval", flag, value])
        assert exited.value.code == 2 and message in capsys.readouterr().err
