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


# Each child touches every page of its block, so the memory is resident, not only reserved.
CHILDREN = (
    "import time\n"
    "kids = []\n"
    "for _ in range({n}):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        block = bytearray({mib} * 2**20)\n"
    "        block[::4096] = b'x' * len(range(0, len(block), 4096))\n"
    "        time.sleep({hold})\n"
    "        os._exit(0)\n"
    "    kids.append(pid)\n"
    "for pid in kids:\n"
    "    os.waitpid(pid, 0)\n"
    "print('children done')\n"
)


def test_memory_is_limited_for_the_run_not_per_process():
    # 8 children of 200 MiB each at 256 MiB: every one fits its own address space, the run does not.
    result = contained(CHILDREN.format(n=8, mib=200, hold=1.5), timeout=8, memory_mb=256)
    assert result.status == "memory" and "children done" not in result.stdout
    assert f"memory-per-run:{SETUP.memory_limit}" in result.isolation


def test_a_run_within_its_memory_runs_ok():
    result = contained(CHILDREN.format(n=4, mib=30, hold=0.5), timeout=8, memory_mb=256)
    assert result.status == "ok" and "children done" in result.stdout


def test_dev_shm_is_capped_and_dev_is_read_only():
    # /dev/shm was a tmpfs of half the machine's memory: 1 GiB written there ran ok at 256 MiB.
    result = contained(
        "written = 0\n"
        "try:\n"
        "    for n in range(80):  # 15 MiB files (the file-size limit is 16 MiB): 1200 MiB in all\n"
        "        with open(f'/dev/shm/f{n}', 'wb') as handle:\n"
        "            for _ in range(15):\n"
        "                handle.write(b'x' * 2**20)\n"
        "                written += 1\n"
        "except OSError as error:\n"
        "    print('refused after', written, 'MiB:', error.strerror)\n"
        "try:\n"
        "    open('/dev/escape', 'w')\n"
        "    print('wrote /dev')\n"
        "except OSError as error:\n"
        "    print('/dev refused:', error.strerror)\n"
        "print(open('/dev/null', 'w').write('fine'))\n",
        memory_mb=512,
    )
    assert result.status == "ok", result.stderr
    refused = next(line for line in result.stdout.splitlines() if line.startswith("refused after"))
    assert int(refused.split()[2]) <= 64 and "No space left on device" in refused
    assert "/dev refused: Read-only file system" in result.stdout and "\n4\n" in result.stdout


# 180 MiB in the three tmpfs of 64 MiB each (files of 15 MiB: the file-size limit is 16 MiB).
FILL = (
    "import time\n"
    "for folder in ('/work', '/tmp', '/dev/shm'):\n"
    "    for n in range(4):\n"
    "        with open(f'{folder}/f{n}', 'wb') as handle:\n"
    "            for _ in range(15):\n"
    "                handle.write(b'x' * 2**20)\n"
)


def test_its_tmpfs_and_memfds_count_towards_its_memory():
    # Three tmpfs of 64 MiB each hold more than a 128 MiB run may: their contents are its memory.
    memfds = (
        "import time\n"
        "held = []\n"
        "for n in range(20):  # memfds live in no mount: only their holders know them\n"
        "    fd = os.memfd_create(f'm{n}')\n"
        "    for _ in range(15):\n"
        "        os.write(fd, b'x' * 2**20)\n"
        "    held.append(fd)\n"
        "time.sleep(1)\n"
        "print('kept')\n"
    )
    for program in (FILL + "time.sleep(1)\nprint('kept')\n", memfds):
        result = contained(program, memory_mb=128)
        assert result.status == "memory" and "kept" not in result.stdout


def test_a_run_that_closed_its_output_is_still_watched():
    # One process cannot pass its address space, but its files can pass the run's memory.
    result = contained("os.close(1)\nos.close(2)\n" + FILL + "time.sleep(60)\n", memory_mb=128)
    assert result.status == "memory"
