"""`reasonkv lm-eval`: what it adds to lm-eval's arguments, and what it says without lm-eval installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def test_without_lm_eval_the_command_says_what_to_install_in_one_line():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["lm_eval"] = None  # lm-eval not installed
        from reasonkv.cli import main
        sys.exit(main(["lm-eval", "--tasks", "reasonkv_gsm8k", "--model_args", "policy=h2o,budget=64"]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=SRC, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "reasonkv lm-eval: error: the Python package 'lm_eval' is not installed (reasonkv's lm-eval model needs "
        "lm-evaluation-harness: pip install 'reasonkv[lm-eval]')"
    ]


def test_a_run_gets_reasonkvs_model_tasks_and_device_unless_given():
    pytest.importorskip("lm_eval")
    from reasonkv.cli.lm_eval import harness_arguments
    from reasonkv.integrations.lm_eval import TASKS_DIR

    tasks = str(TASKS_DIR)
    assert harness_arguments(["--tasks", "reasonkv_gsm8k"], cuda=False) == [
        "run", "--model", "reasonkv", "--include_path", tasks, "--device", "cpu", "--tasks", "reasonkv_gsm8k"
    ]  # fmt: skip
    given = ["run", "-M", "hf", "--include_path=mine", "--device", "cuda:1", "--tasks", "x"]
    assert harness_arguments(given, cuda=True) == given
    assert harness_arguments(["--config", "run.yaml"], cuda=True) == [
        "run",
        "--include_path",
        tasks,
        "--config",
        "run.yaml",
    ]
    assert harness_arguments(["ls", "tasks"], cuda=False) == ["ls", "tasks", "--include_path", tasks]
    assert (TASKS_DIR / "reasonkv_gsm8k.yaml").is_file()
