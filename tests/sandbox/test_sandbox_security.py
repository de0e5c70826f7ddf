"""The sandbox contains what model-written programs may do: each case is run for real, bounded in time,
and afterwards no process of it is left and nothing outside it has changed.

Needs bubblewrap (``apt-get install bubblewrap``; ``scripts/setup.sh`` installs it when run as root). Where
it is missing the cases are skipped, unless ``REASONKV_REQUIRE_SANDBOX=1`` (CI sets it) makes that a failure.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from reasonkv import sandbox

SETUP = sandbox.probe()
if SETUP.mechanism != "bubblewrap":
    if os.environ.get("REASONKV_REQUIRE_SANDBOX"):
        raise RuntimeError(f"bubblewrap is required here and unusable: {SETUP.reason}")
    pytest.skip(f"bubblewrap is not usable here: {SETUP.reason}", allow_module_level=True)

TIMEOUT = 2.0
SLACK = 4.0  # the most a contained case may take beyond its timeout (set-up, kill, reaping)

# Printed first by every case: the PID namespace it runs in, to look for its processes afterwards.
NAMESPACE = "import os, sys\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\n"


def _alive_in(namespace: str) -> list[int]:
    """Live (not zombie) host processes in ``namespace``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone, or a zombie (it has no namespace any more)
        if state != "Z":
            found.append(int(entry))
    return found


def contained(program: str, stdin: str = "", timeout: float = TIMEOUT, memory_mb: int = 256) -> sandbox.RunResult:
    """Run ``program`` after the namespace line; check the time bound and that no process is left."""
    start = time.monotonic()
    result = sandbox.run(NAMESPACE + program, stdin, timeout=timeout, memory_mb=memory_mb)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + SLACK, f"took {elapsed:.1f} s"
    namespace = result.stdout.split("\n", 1)[0]
    assert namespace.startswith("pid:[") and namespace != os.readlink("/proc/self/ns/pid")
    deadline = time.monotonic() + SLACK
    while _alive_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive_in(namespace), f"processes left: {_alive_in(namespace)}"
    print(f"\n{result.status:13s} {elapsed:6.2f} s  returncode {result.returncode}")
    return result


def test_fork_bomb():
    result = contained("while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert result.status == "timeout"


def test_memory_bomb():
    result = contained("chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))\n", memory_mb=256)
    assert result.status == "memory"
    assert "MemoryError" in result.stderr


def test_infinite_loop():
    assert contained("while True:\n    pass\n").status == "timeout"


def test_sleep_past_the_timeout():
    result = contained("import time\ntime.sleep(60)\nprint('woke')\n")
    assert result.status == "timeout" and "woke" not in result.stdout


def test_setsid_daemon_that_outlives_its_parent():
    # The daemon double-forks into a new session and would sleep for a minute: it dies with the sandbox.
    result = contained(
        "import time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('parent done')\n"
    )
    assert result.status == "ok" and "parent done" in result.stdout


def test_writes_outside_its_directory_change_nothing(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text('{"kind": "manifest"}\n')
    before = results.read_bytes()
    name = f"reasonkv-escape-{uuid.uuid4().hex}"
    home = Path(os.path.expanduser("~"))
    program = (
        f"targets = [{str(results)!r}, {str(home / name)!r}, '/tmp/{name}', os.path.expanduser('~/{name}')]\n"
        "for target in targets:\n"
        "    try:\n"
        "        with open(target, 'a') as handle:\n"
        "            handle.write('escaped')\n"
        "        print('wrote', target)\n"
        "    except OSError as error:\n"
        "        print('refused', target, type(error).__name__)\n"
    )
    result = contained(program)
    assert result.status == "ok"
    assert results.read_bytes() == before
    assert not (home / name).exists() and not (Path("/tmp") / name).exists()
    assert f"refused {results}" in result.stdout  # the results file is not even visible inside


def test_the_parents_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("REASONKV_TEST_SECRET", "hunter2")
    result = contained("print(sorted(os.environ))\nprint(os.environ.get('REASONKV_TEST_SECRET'))\n")
    assert result.status == "ok"
    assert "hunter2" not in result.stdout and "REASONKV_TEST_SECRET" not in result.stdout
    assert "HOME" not in result.stdout


def test_no_connection_to_a_local_port():
    accepted = []
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            with contextlib.suppress(OSError):  # the accept timeout: look at the stop flag again
                accepted.append(server.accept())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        result = contained(
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('connected')\n"
            "except OSError as error:\n"
            "    print('refused', type(error).__name__)\n"
        )
    finally:
        stop.set()
        thread.join()
        server.close()
    assert result.status == "ok" and "refused" in result.stdout
    assert not accepted


def test_killing_its_parent_leaves_the_grader_alive():
    result = contained("os.kill(os.getppid(), 9)\nprint('still here')\n")
    assert result.status == "ok" and "still here" in result.stdout  # the sandbox's init ignores the signal
    assert os.getpid() > 0  # this process (the grader) is untouched


def test_a_gigabyte_of_output_costs_at_most_the_cap():
    result = contained("line = 'x' * (2**20 - 1) + '\\n'\nfor _ in range(1024):\n    sys.stdout.write(line)\n")
    assert result.status == "output-limit"
    assert len(result.stdout.encode()) <= sandbox.OUTPUT_LIMIT


def test_closing_its_stdout():
    result = contained("os.close(1)\nos.close(2)\nimport time\ntime.sleep(60)\n")
    assert result.status == "timeout"  # its output closed early; the deadline still holds


def test_deleting_its_working_directory():
    result = contained(
        "import shutil\n"
        "open('scratch.txt', 'w').write('x')\n"
        "shutil.rmtree(os.getcwd(), ignore_errors=True)\n"
        "print('left:', os.listdir('.'))\n"
        "try:\n"
        "    os.rmdir(os.getcwd())\n"
        "except OSError as error:\n"
        "    print('rmdir', type(error).__name__)\n"
    )
    assert result.status == "ok" and "left: []" in result.stdout and "rmdir" in result.stdout


def _descendants(root: int) -> dict[int, tuple[str, set[int]]]:
    """Live descendants of ``root`` seen from the host: pid -> (name, its real/effective/saved/fs uids)."""
    parents, found = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor not in (None, root, 0, 1):
            ancestor = parents.get(ancestor)
        if ancestor == root:
            with contextlib.suppress(OSError):
                status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
                found[pid] = (status["Name"].strip(), {int(uid) for uid in status["Uid"].split()})
    return found


def test_every_process_of_a_run_is_unprivileged_on_the_host():
    # Seen from the host, bubblewrap and everything it starts run as the sandbox's uid (never root), and the
    # program inside holds no capability and cannot switch to root.
    program = (
        "import time\n"
        "status = open('/proc/self/status').read()\n"
        "print([line for line in status.splitlines() if line.startswith(('CapEff', 'NoNewPrivs'))])\n"
        "try:\n"
        "    os.setuid(0)\n"
        "    print('became root')\n"
        "except OSError as error:\n"
        "    print('setuid refused', type(error).__name__)\n"
        "time.sleep(1.5)\n"
    )
    results, seen = [], {}
    runner = threading.Thread(target=lambda: results.append(contained(program)))
    runner.start()
    while runner.is_alive():
        seen.update(_descendants(os.getpid()))
        time.sleep(0.05)
    runner.join()
    (result,) = results
    assert result.status == "ok" and "setuid refused" in result.stdout and "became root" not in result.stdout
    assert "'CapEff:\\t0000000000000000'" in result.stdout and "'NoNewPrivs:\\t1'" in result.stdout
    names = {name for name, _ in seen.values()}
    assert "bwrap" in names and any(name.startswith("python") for name in names), seen
    expected = SETUP.user.uid if os.geteuid() == 0 else os.geteuid()
    assert all(uids == {expected} for _, uids in seen.values()), seen
    assert expected != 0


def test_every_result_names_its_isolation():
    result = sandbox.run("print('hi')")
    assert result.status == "ok" and result.stdout == "hi\n"
    for mechanism in ("pid-namespace", "network-namespace", "mount-namespace", "user-namespace", "rlimits"):
        assert mechanism in result.isolation
