"""CI's fresh machine gets bubblewrap from ``scripts/setup.sh``, and there the security tests must run, not skip.

The script runs for real with a ``PATH`` of stand-ins (``id``, ``apt-get``, a Python that fails), so it stops
right after its bubblewrap step, having touched nothing of this machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _setup_sh(tmp_path: Path, uid: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run scripts/setup.sh as ``uid`` on a machine without bwrap; the apt-get calls it made."""
    bin_dir, log = tmp_path / "bin", tmp_path / "apt.log"
    bin_dir.mkdir()
    os.symlink(shutil.which("dirname"), bin_dir / "dirname")
    _tool(bin_dir, "id", f"echo {uid}\n")
    # apt-get records its arguments; installing bubblewrap puts a bwrap on PATH, as the package does.
    bwrap = bin_dir / "bwrap"
    installs = f"echo '#!/bin/sh' > {bwrap}; {shutil.which('chmod')} 755 {bwrap}"
    _tool(bin_dir, "apt-get", f'echo "$*" >> {log}\ncase "$*" in *install*bubblewrap*) {installs};; esac\n')
    _tool(bin_dir, "python-that-fails", "exit 3\n")  # the venv step: the script stops there
    env = {"PATH": str(bin_dir), "PYTHON": "python-that-fails", "VENV": str(tmp_path / "venv")}
    done = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return done, calls


def test_as_root_setup_installs_bubblewrap_with_apt(tmp_path):
    done, calls = _setup_sh(tmp_path, uid=0)
    assert done.returncode == 3, done.stderr  # went past the bubblewrap step, on to the venv
    assert calls[0].startswith("update") and "install -y -qq bubblewrap" in calls[1]
    assert (tmp_path / "bin" / "bwrap").exists()


def test_without_root_setup_only_says_bubblewrap_is_missing(tmp_path):
    done, calls = _setup_sh(tmp_path, uid=1000)
    assert done.returncode == 3 and calls == []
    assert "bubblewrap is not installed" in done.stderr


def test_ci_requires_the_sandbox_before_running_the_suite():
    lines = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert lines.index("export REASONKV_REQUIRE_SANDBOX=1") < lines.index("./scripts/setup.sh && .venv/bin/pytest")
