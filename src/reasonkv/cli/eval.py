"""``reasonkv eval``: run (or resume) a benchmark grid, appending one JSON record per result.

Rerunning the same command after an interruption skips the records already in ``--out``; under torchrun, or
with ``--shard I/N``, each process writes its own shard file and the last to finish merges them
(docs/eval-at-scale.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reasonkv.cli.flags import add_flags, read_flags
from reasonkv.cli.outputs import check_results_path
from reasonkv.eval.grid import GridSpec
from reasonkv.eval.plan import GridPlan, plan_grid
from reasonkv.eval.runner import run_grid
from reasonkv.eval.settings import CODE_GROUP, EvalSettings
from reasonkv.runs.paths import command_line

EPILOG = (
    "Policy options: -o KEY=VALUE goes to every listed policy that has the option KEY (an error if none "
    "has it); -o POLICY.KEY=VALUE to that policy only. Records already in --out are skipped, so rerunning "
    "the same command resumes an interrupted run. full runs once per problem whatever the budgets, and "
    "gets no fidelity records (it is the reference). Under torchrun each process takes one shard of the grid "
    "(and cuda:LOCAL_RANK with --device cuda); the last to finish merges the shard files into --out."
)
#: The settings run_grid takes under their own name.
_RUN = ("out", "dtype", "device", "progress", "shard", "retry_errors", "repair")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    add_flags(parser, EvalSettings, descriptions=dict([CODE_GROUP]))


def settings_from(args: argparse.Namespace) -> EvalSettings:
    return EvalSettings(**read_flags(EvalSettings, args))


def time_estimate(plan: GridPlan, tokens_per_second: float | None) -> str:
    """The plan's most decode steps at a measured speed: an upper bound, since answers that stop early take less.

    A fidelity replay steps the reference trace through the full cache and the evicting one (both counted).
    """
    most, replay = plan.grid.sampling.max_new_tokens, plan.grid.replay_tokens
    steps = sum(most if unit.kind == "generation" else 2 * replay for unit in plan.mine())
    whose = "this shard's" if plan.shard.count > 1 else "the"
    what = f"{steps:,} decode steps ({whose} generations, and both caches of each fidelity replay)"
    if tokens_per_second is None:
        return f"time: at most {what}; pass --tokens-per-second N, measured on this machine, for an estimate"
    return (
        f"time: at most {_duration(steps / tokens_per_second)}: {what} at {tokens_per_second:g} tok/s "
        "(--tokens-per-second, as measured); answers that stop early take less"
    )


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    if minutes < 1:
        return f"{seconds:.0f} s"
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def grid_from(args: argparse.Namespace) -> GridSpec:
    """The grid the arguments describe (everything checked that needs no model)."""
    return settings_from(args).grid()


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    grid = settings.grid()
    if settings.tokens_per_second is not None and not settings.plan:
        raise ValueError("--tokens-per-second is for the time estimate of --plan: add --plan, or leave it out")
    if settings.plan:
        plan = plan_grid(grid, shard=settings.shard)
        print(plan.summary())
        print(time_estimate(plan, settings.tokens_per_second))
        return 0
    check_results_path(settings.out)
    command = command_line(Path(settings.out).parent)
    given = {name: getattr(settings, name) for name in _RUN}
    result = run_grid(settings.model, grid=grid, attn_implementation=settings.attn, command=command, **given)
    print(result.summary(), file=sys.stderr)
    return 1 if result.complete and result.failed else 0
