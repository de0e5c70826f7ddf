"""``reasonkv eval``'s settings, each flag a field (:mod:`reasonkv.runs.flags`); :meth:`EvalSettings.grid` hands
them to :meth:`~reasonkv.eval.grid.GridSpec.build`, which checks them as it does for the Python API.
"""

from __future__ import annotations

from dataclasses import dataclass

from reasonkv.cache.allocation import ALLOCATIONS, Uniform
from reasonkv.cache.spec import DEFAULT_BUFFER
from reasonkv.eval.grid import GridSpec
from reasonkv.models import DEFAULT_MODEL
from reasonkv.runs.flags import setting
from reasonkv.sandbox.limits import MAX_TIMEOUT

__all__ = ["CODE_GROUP", "EvalSettings"]

#: The code problems' group: its title, and what it says before its flags.
CODE_GROUP = (
    "code problems (humaneval, LiveCodeBench files, code-function / code-stdio rows)",
    "Code answers are graded by running them, each test in a sandbox (bubblewrap: its own user, PID, "
    "network and mount namespaces, an unprivileged uid, resource limits); running them needs "
    "--allow-code-execution.",
)
_CODE = CODE_GROUP[0]
_TIER = {"what": "; applies to every evicting policy, full runs without one"}
_COMPILE = {"what": "generation's decode step (fidelity replays stay eager)"}
_THINKING = {"auto": None, "on": True, "off": False}
# The settings GridSpec.build takes under their own name.
_CELLS = ("policies", "budgets", "buffer", "quantized", "bits", "allocations", "budgets_file")
_DECODING = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "batch_size")
_GRID = (*_CELLS, *_DECODING, "dataset", "limit", "samples", "fidelity", "fidelity_tokens", "trace_problems", "compile")


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """Everything one ``reasonkv eval`` is told (the fields are its flags, in the order ``--help`` shows them):
    the model, the grid (:meth:`grid`), where the records go and how the processes share the work."""

    model: str = setting(DEFAULT_MODEL, group="model", shared="model")
    dtype: str = setting("fp32", group="model", shared="model")
    device: str = setting("cpu", group="model", shared="model")
    attn: str = setting("sdpa", group="model", shared="model")
    dataset: str = setting(
        group="grid",
        required=True,
        help="gsm8k | math500 | aime24 | aime25 | hmmt25 | gpqa | humaneval | a .jsonl file (LiveCodeBench's "
        "release files too); several comma-separated, each optionally NAME:LIMIT (e.g. gsm8k:40,math500:20)",
    )
    policies: str = setting("full,streaming", group="grid", help="comma-separated policies (default full,streaming)")
    budgets: tuple[int, ...] = setting(
        (256,), group="grid", type="int-list", help="comma-separated K values (default 256); full ignores them"
    )
    buffer: int = setting(DEFAULT_BUFFER, group="grid", shared="buffer")
    quantized: int = setting(0, group="grid", shared="tier", shared_with=_TIER)
    bits: int | None = setting(None, group="grid", shared="tier", shared_with=_TIER)
    allocations: str = setting(
        Uniform.name,
        group="grid",
        help=f"comma-separated allocations each evicting policy runs under ({', '.join(ALLOCATIONS)}; default "
        f"{Uniform.name}): how K x layers x kv-heads is shared, labelled POLICY~ALLOCATION (docs/budgets.md)",
    )
    budgets_file: str | None = setting(None, group="grid", help="the budget file of the calibrated allocation")
    option: tuple[str, ...] = setting((), group="grid", repeated=True, short="-o", shared="policy options")
    limit: int | None = setting(None, group="grid", type=int, help="first N problems of each dataset (default all)")
    samples: str = setting(
        "1",
        group="grid",
        help="samples per problem (default 1), or per dataset: aime25=64,math500=8 (a bare N is the default of "
        "the others); at temperature 0 only stochastic policies run more than one",
    )
    allow_code_execution: bool = setting(
        False,
        group=_CODE,
        help="run the programs the model writes (in the sandbox); without it a grid with code problems is refused",
    )
    code_timeout: float = setting(
        6.0, group=_CODE, type="code-timeout", help=f"seconds per test run, at most {MAX_TIMEOUT:g} (default 6)"
    )
    code_memory: int = setting(
        1024,
        group=_CODE,
        type="code-memory",
        metavar="MIB",
        help="memory per test run, all its processes together (default 1024): a cgroup of its own where this "
        "machine allows one, else summed and enforced by the sandbox's supervisor; run manifests name which",
    )
    code_workers: int | None = setting(
        None, group=_CODE, type=int, help="test runs at once (default: one per CPU); results do not change"
    )
    sandbox_allow_missing: str = setting(
        "",
        group=_CODE,
        metavar="GUARANTEES",
        help="run although the sandbox cannot guarantee these here (comma-separated: network, process-tree, "
        "filesystem); the default refuses, naming what is missing",
    )
    sandbox_allow_network: bool = setting(
        False,
        group=_CODE,
        help="run although the sandbox cannot cut the network here (same as --sandbox-allow-missing network)",
    )
    after: str | None = setting(
        None, group=_CODE, metavar="YYYY-MM-DD", help="only problems of contests on or after this day"
    )
    before: str | None = setting(
        None, group=_CODE, metavar="YYYY-MM-DD", help="only problems of contests on or before this day"
    )
    max_new_tokens: int = setting(512, group="decoding", type=int, help="default 512")
    temperature: float = setting(0.0, group="decoding", type=float, help="0 = greedy (default)")
    top_p: float = setting(1.0, group="decoding", type=float)
    top_k: int = setting(0, group="decoding", type=int)
    seed: int = setting(
        0, group="decoding", type=int, help="base seed; sample s of problem p uses a hash of (seed, p, s)"
    )
    batch_size: int = setting(8, group="decoding", type=int, help="prompts decoded together (default 8)")
    compile: bool = setting(False, group="decoding", shared="compile", shared_with=_COMPILE)
    thinking: str = setting(
        "auto",
        group="decoding",
        choices=tuple(_THINKING),
        help="enable_thinking for Qwen3-style chat templates (default: the template's own default)",
    )
    out: str = setting("results.jsonl", group="output", help="JSONL results file, appended to (default results.jsonl)")
    fidelity: bool | None = setting(
        None,
        group="output",
        help="also measure fidelity to the full cache (default: on when the dataset has reference solutions)",
    )
    fidelity_only: bool = setting(
        False,
        group="output",
        help="only fidelity records for the evicting policies (no generation records: about half the time); "
        "full still generates when listed, its outputs are the traces replayed",
    )
    fidelity_tokens: int | None = setting(
        None,
        group="output",
        type=int,
        help="length of the full-cache greedy trace replayed for fidelity (default --max-new-tokens)",
    )
    trace_problems: str = setting(
        "",
        group="output",
        metavar="ID,...",
        help="keep the eviction trace of these problems' generations in OUT's .traces folder "
        "(open one with `reasonkv inspect --trace FILE --out page.html`)",
    )
    progress: bool = setting(True, group="output", negated=True, in_command=False, help="no progress bars")
    shard: str | None = setting(
        None,
        group="processes",
        metavar="I/N",
        help="run shard I of N (counted from 0) of the grid, into OUT's shard file; for schedulers that start "
        "independent jobs (torchrun sets it by itself)",
    )
    retry_errors: bool = setting(False, group="processes", help="run again the units whose record is an error")
    repair: bool = setting(
        False,
        group="processes",
        help="move the lines of --out (and its shard files) that are not records, e.g. after a hand edit, to "
        "<file>.rejected-<date>, and resume from the rest",
    )
    plan: bool = setting(
        False,
        group="processes",
        help="print the grid's units, the most tokens they may generate and each shard's share; load nothing",
    )
    tokens_per_second: float | None = setting(
        None,
        group="processes",
        type="positive-rate",
        metavar="N",
        help="with --plan: new tokens per second measured on this machine, model and device, for a time estimate "
        "beside the token counts (the tok/s `reasonkv generate` prints is one row's: a batch decodes more, so the "
        "estimate is then an upper bound)",
    )

    def grid(self) -> GridSpec:
        """The grid these settings describe (everything checked that needs no model)."""
        return GridSpec.build(
            **{name: getattr(self, name) for name in _GRID},
            options=self.option,
            generation=not self.fidelity_only,
            thinking=_THINKING[self.thinking],
            code=dict(
                allow_execution=self.allow_code_execution,
                timeout=self.code_timeout,
                memory_mb=self.code_memory,
                workers=self.code_workers,
                allow_missing=self.sandbox_allow_missing.split(",") + ["network"] * self.sandbox_allow_network,
                after=self.after,
                before=self.before,
            ),
        )
