"""The sandbox's public API, its statuses, and what it says and does where bubblewrap cannot be used."""

from __future__ import annotations

import inspect
import os
import stat
import tempfile
from pathlib import Path

import pytest

from reasonkv import sandbox
from reasonkv.sandbox import GUARANTEES, Sandbox, SandboxUnavailable
from reasonkv.sandbox.limits import machine_memory_mb

ALL = tuple(GUARANTEES)


def test_run_has_the_documented_signature():
    parameters = inspect.signature(sandbox.run).parameters
    assert [(p.name, p.default) for p in parameters.values()] == [
        ("source", inspect.Parameter.empty),
        ("stdin", ""),
        ("timeout", 10.0),
        ("memory_mb", 1024),
    ]
    assert sandbox.STATUSES == ("ok", "failed", "timeout", "memory", "output-limit", "killed")


def test_without_bubblewrap_it_names_every_missing_guarantee_and_refuses():
    plain = Sandbox(bwrap=None)
    assert plain.setup.mechanism == "process" and set(plain.setup.missing) == set(ALL)
    with pytest.raises(SandboxUnavailable) as refused:
        plain.run("print('never')")
    message = str(refused.value)
    for name, (_, consequence) in GUARANTEES.items():
        assert name in message and consequence in message
    assert "--sandbox-allow-missing network,process-tree,filesystem" in message
    with pytest.raises(SandboxUnavailable, match="cannot guarantee process-tree, filesystem"):
        Sandbox(bwrap=None, allow_missing=["network"]).run("print('never')")  # one allowed, two still missing


def test_a_bubblewrap_that_cannot_create_namespaces_is_named():
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)  # the sandbox's user starts it
        fake = Path(folder) / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        setup = sandbox.probe(str(fake))
        assert setup.mechanism == "process" and set(setup.missing) == set(ALL)
        assert "No permissions to create new namespace" in setup.reason
        if os.geteuid() == 0:  # a bubblewrap its user may not start
            fake.chmod(0o700)
            os.chmod(folder, 0o700)
            setup = sandbox.probe(f"{folder}/./bwrap")  # another spelling: probed again
            assert setup.mechanism == "process" and "Permission denied" in setup.reason
    assert "not installed" in sandbox.probe("no-such-bwrap-here").reason


def test_the_process_runner_runs_only_when_allowed_and_says_what_it_lacks(monkeypatch):
    monkeypatch.setenv("REASONKV_TEST_SECRET", "hunter2")
    before = set(Path(tempfile.gettempdir()).glob("reasonkv-sandbox-*"))
    plain = Sandbox(bwrap=None, allow_missing=ALL)
    result = plain.run("import os\nprint(sorted(os.environ), os.listdir('.'), os.getuid())\n")
    assert result.status == "ok"
    assert "REASONKV_TEST_SECRET" not in result.stdout and "[]" in result.stdout  # empty env, empty cwd
    if os.geteuid() == 0:
        assert result.stdout.split()[-1] == str(plain.setup.user.uid) != "0"  # dropped to an unprivileged uid
    assert "rlimits" in result.isolation and not {"pid-namespace", "network-namespace"} & set(result.isolation)
    assert "memory-per-process" in result.isolation  # no run-wide memory limit without bubblewrap: said so
    assert set(Path(tempfile.gettempdir()).glob("reasonkv-sandbox-*")) == before  # its directory is removed
    assert plain.run("x = bytearray(2**31)\n", memory_mb=256).status == "memory"
    assert plain.run("while True:\n    pass\n", timeout=1).status == "timeout"


@pytest.fixture(scope="module")
def usable() -> Sandbox:
    return Sandbox(allow_missing=() if sandbox.probe().mechanism == "bubblewrap" else ALL)


@pytest.mark.parametrize(
    ("program", "status", "returncode"),
    [
        ("print(input()[::-1])", "ok", 0),
        ("import sys\nsys.exit(3)", "failed", 3),
        ("raise ValueError('no')", "failed", 1),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "killed", 128 + 11),
        (
            "import resource, signal\nsignal.signal(signal.SIGXCPU, signal.SIG_DFL)\nwhile True:\n    pass",
            "timeout",
            None,
        ),
    ],
)
def test_statuses(usable, program, status, returncode):
    result = usable.run(program, "olleh\n", timeout=2)
    assert result.status == status
    if returncode is not None:
        assert result.returncode == returncode
    if status == "ok":
        assert result.stdout == "hello\n" and result.stderr == ""


def test_bad_arguments_are_refused(usable):
    top = machine_memory_mb()
    for kwargs, message in [
        (dict(timeout=0), r"timeout must be a number of seconds in \(0, 3600\], got 0$"),
        (dict(timeout=float("inf")), r"in \(0, 3600\], got inf$"),
        (dict(timeout=1e9), r"in \(0, 3600\], got 1000000000.0$"),  # it once raised OverflowError
        (dict(timeout=3600.5), r"got 3600.5$"),
        (dict(memory_mb=16), rf"memory_mb must be an integer number of MiB from 64 to {top} .*got 16$"),
        (dict(memory_mb=top + 1), rf"from 64 to {top} \(this machine's memory\), got {top + 1}$"),
        (dict(memory_mb=2**62), "got 4611686018427387904$"),
        (dict(memory_mb=512.0), "got 512.0$"),
    ]:
        with pytest.raises(ValueError, match=message):
            usable.run("pass", **kwargs)
    with pytest.raises(TypeError, match="source must be a str"):
        usable.run(b"pass")
    with pytest.raises(ValueError, match="unknown sandbox guarantee everything"):
        Sandbox(allow_missing=["everything"])


def test_the_interpreter_is_one_the_sandbox_user_can_read():
    setup = sandbox.probe()
    path = Path(setup.interpreter.path)
    if setup.user.switch:  # root drops to another uid: every folder on the way must let it through
        for folder in [*reversed(path.parents), path]:
            assert folder.stat().st_mode & stat.S_IXOTH
