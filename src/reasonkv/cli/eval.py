"""``reasonkv eval``: run (or resume) a benchmark grid, appending one JSON record per result.

Example::

    reasonkv eval --dataset gsm8k:40,math500:20 --policies full,streaming,epikv \\
        --budgets 128,256 --buffer 128 --max-new-tokens 512 --out results.jsonl

Rerun the same command after an interruption: records already in ``--out`` (and its shard files)
are skipped. Across processes, one launcher command::

    torchrun --nproc_per_node 8 -m reasonkv eval --device cuda ... --out results.jsonl

or one job per shard (``--shard I/N``, e.g. a Slurm array): each process writes
``results.shard-I-of-N.jsonl``, and the last to finish merges them into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from reasonkv.cli.args import (
    add_buffer_argument,
    add_compile_argument,
    add_model_arguments,
    add_policy_options,
    add_tier_arguments,
    code_memory_argument,
    code_timeout_argument,
)
from reasonkv.cli.outputs import check_results_path
from reasonkv.eval.grid import GridSpec
from reasonkv.eval.plan import GridPlan, plan_grid
from reasonkv.eval.runner import run_grid
from reasonkv.runs.paths import command_line
from reasonkv.sandbox.limits import MAX_TIMEOUT


def _int_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            values.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


EPILOG = (
    "Policy options: -o KEY=VALUE goes to every listed policy that has the option KEY (an error if none "
    "has it); -o POLICY.KEY=VALUE to that policy only. Records already in --out are skipped, so rerunning "
    "the same command resumes an interrupted run. full runs once per problem whatever the budgets, and "
    "gets no fidelity records (it is the reference). Under torchrun each process takes one shard of the grid "
    "(and cuda:LOCAL_RANK with --device cuda); the last to finish merges the shard files into --out."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    add_model_arguments(parser)
    grid = parser.add_argument_group("grid")
    grid.add_argument(
        "--dataset",
        required=True,
        help="gsm8k | math500 | aime24 | aime25 | hmmt25 | gpqa | humaneval | a .jsonl file (LiveCodeBench's "
        "release files too); several comma-separated, each optionally NAME:LIMIT (e.g. gsm8k:40,math500:20)",
    )
    grid.add_argument("--policies", default="full,streaming", help="comma-separated policies (default full,streaming)")
    grid.add_argument(
        "--budgets", type=_int_list, default=[256], help="comma-separated K values (default 256); full ignores them"
    )
    add_buffer_argument(grid)
    add_tier_arguments(grid, what="; applies to every evicting policy, full runs without one")
    grid.add_argument(
        "--allocations",
        default="uniform",
        help="comma-separated allocations each evicting policy runs under (uniform, pyramid, adaptive, calibrated; "
        "default uniform): how K x layers x kv-heads is shared, labelled POLICY~ALLOCATION (docs/budgets.md)",
    )
    grid.add_argument("--budgets-file", default=None, help="the budget file of the calibrated allocation")
    add_policy_options(grid)
    grid.add_argument("--limit", type=int, default=None, help="first N problems of each dataset (default all)")
    grid.add_argument(
        "--samples",
        default="1",
        help="samples per problem (default 1), or per dataset: aime25=64,math500=8 (a bare N is the default of "
        "the others); at temperature 0 only stochastic policies run more than one",
    )
    add_code_arguments(parser)
    sampling = parser.add_argument_group("decoding")
    sampling.add_argument("--max-new-tokens", type=int, default=512, help="default 512")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument(
        "--seed", type=int, default=0, help="base seed; sample s of problem p uses a hash of (seed, p, s)"
    )
    sampling.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")
    add_compile_argument(sampling, what="generation's decode step (fidelity replays stay eager)")
    sampling.add_argument(
        "--thinking",
        choices=("auto", "on", "off"),
        default="auto",
        help="enable_thinking for Qwen3-style chat templates (default: the template's own default)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out", default="results.jsonl", help="JSONL results file, appended to (default results.jsonl)"
    )
    output.add_argument(
        "--fidelity",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure fidelity to the full cache (default: on when the dataset has reference solutions)",
    )
    output.add_argument(
        "--fidelity-only",
        action="store_true",
        help="only fidelity records for the evicting policies (no generation records: about half the time); "
        "full still generates when listed, its outputs are the traces replayed",
    )
    output.add_argument(
        "--fidelity-tokens",
        type=int,
        default=None,
        help="length of the full-cache greedy trace replayed for fidelity (default --max-new-tokens)",
    )
    output.add_argument(
        "--trace-problems",
        default="",
        metavar="ID,...",
        help="keep the eviction trace of these problems' generations in OUT's .traces folder "
        "(open one with `reasonkv inspect --trace FILE --out page.html`)",
    )
    output.add_argument("--no-progress", action="store_true", help="no progress bars")
    run = parser.add_argument_group("processes")
    run.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="run shard I of N (counted from 0) of the grid, into OUT's shard file; for schedulers that start "
        "independent jobs (torchrun sets it by itself)",
    )
    run.add_argument("--retry-errors", action="store_true", help="run again the units whose record is an error")
    run.add_argument(
        "--repair",
        action="store_true",
        help="move the lines of --out (and its shard files) that are not records, e.g. after a hand edit, to "
        "<file>.rejected-<date>, and resume from the rest",
    )
    run.add_argument(
        "--plan",
        action="store_true",
        help="print the grid's units, the most tokens they may generate and each shard's share; load nothing",
    )
    run.add_argument(
        "--tokens-per-second",
        type=_positive_rate,
        default=None,
        metavar="N",
        help="with --plan: new tokens per second measured on this machine, model and device, for a time estimate "
        "beside the token counts (the tok/s `reasonkv generate` prints is one row's: a batch decodes more, so the "
        "estimate is then an upper bound)",
    )


def add_code_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of code problems: the opt-in, the sandbox's limits and allowances, LiveCodeBench's window."""
    code = parser.add_argument_group(
        "code problems (humaneval, LiveCodeBench files, code-function / code-stdio rows)",
        "Code answers are graded by running them, each test in a sandbox (bubblewrap: its own user, PID, "
        "network and mount namespaces, an unprivileged uid, resource limits); running them needs "
        "--allow-code-execution.",
    )
    code.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="run the programs the model writes (in the sandbox); without it a grid with code problems is refused",
    )
    code.add_argument(
        "--code-timeout",
        type=code_timeout_argument,
        default=6.0,
        help=f"seconds per test run, at most {MAX_TIMEOUT:g} (default 6)",
    )
    code.add_argument(
        "--code-memory",
        type=code_memory_argument,
        default=1024,
        metavar="MIB",
        help="memory per test run, all its processes together (default 1024): a cgroup of its own where this "
        "machine allows one, else summed and enforced by the sandbox's supervisor; run manifests name which",
    )
    code.add_argument(
        "--code-workers", type=int, default=None, help="test runs at once (default: one per CPU); results do not change"
    )
    code.add_argument(
        "--sandbox-allow-missing",
        default="",
        metavar="GUARANTEES",
        help="run although the sandbox cannot guarantee these here (comma-separated: network, process-tree, "
        "filesystem); the default refuses, naming what is missing",
    )
    code.add_argument(
        "--sandbox-allow-network",
        action="store_true",
        help="run although the sandbox cannot cut the network here (same as --sandbox-allow-missing network)",
    )
    code.add_argument(
        "--after", default=None, metavar="YYYY-MM-DD", help="only problems of contests on or after this day"
    )
    code.add_argument(
        "--before", default=None, metavar="YYYY-MM-DD", help="only problems of contests on or before this day"
    )


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
    return GridSpec.build(
        dataset=args.dataset,
        policies=args.policies,
        budgets=args.budgets,
        buffer=args.buffer,
        options=args.option,
        quantized=args.quantized,
        bits=args.bits,
        allocations=args.allocations,
        budgets_file=args.budgets_file,
        limit=args.limit,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        batch_size=args.batch_size,
        fidelity=args.fidelity,
        fidelity_tokens=args.fidelity_tokens,
        generation=not args.fidelity_only,
        thinking={"auto": None, "on": True, "off": False}[args.thinking],
        code=dict(
            allow_execution=args.allow_code_execution,
            timeout=args.code_timeout,
            memory_mb=args.code_memory,
            workers=args.code_workers,
            allow_missing=args.sandbox_allow_missing.split(",") + ["network"] * args.sandbox_allow_network,
            after=args.after,
            before=args.before,
        ),
        trace_problems=args.trace_problems,
        compile=args.compile,
    )


def _positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens per second, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens per second, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    grid = grid_from(args)
    if args.tokens_per_second is not None and not args.plan:
        raise ValueError("--tokens-per-second is for the time estimate of --plan: add --plan, or leave it out")
    if args.plan:
        plan = plan_grid(grid, shard=args.shard)
        print(plan.summary())
        print(time_estimate(plan, args.tokens_per_second))
        return 0
    check_results_path(args.out)
    result = run_grid(
        args.model,
        grid=grid,
        out=args.out,
        dtype=args.dtype,
        device=args.device,
        attn_implementation=args.attn,
        progress=not args.no_progress,
        shard=args.shard,
        retry_errors=args.retry_errors,
        repair=args.repair,
        command=command_line(Path(args.out).parent),
    )
    print(result.summary(), file=sys.stderr)
    return 1 if result.complete and result.failed else 0
