"""``reasonkv bench``: speed and memory of every policy, side by side, written as it is measured.

Three measurements, combinable in one run (one model load):

- the length sweep (default; ``--lengths``): tokens/s, time per step, its split into forward /
  record / observe / score / gather, memory and cache slots at each length, per policy and batch
  size; ``--prefill-to-length`` reaches each length by a prefill instead of decoding every token;
- ``--eviction-cost --cached N``: the time of one eviction when the cache holds ``N`` tokens;
- ``--max-batch --memory-limit M --length L``: the largest batch each policy fits in ``M`` at
  ``L`` tokens, and the throughput measured at that batch.

``--quantized Q --bits b`` adds a quantized-tier variant of every requested evicting policy to the
length sweep, at the K/V bytes of the plain policy (:mod:`reasonkv.bench.tiers`).
``--allocation pyramid|adaptive|calibrated`` runs the length sweep's evicting entries under per-(layer,
kv-head) budgets and reports their K/V bytes per layer (:mod:`reasonkv.bench.layers`). A selection policy
(``quest``, ``seer``) is reported with the K/V bytes its decode steps read beside those it holds
(:mod:`reasonkv.bench.reads`).

Outputs in ``--out``: ``results.jsonl`` (one record per finished entry, appended as measured),
``bench.json`` (everything, with the command line, date, machine and versions), ``bench.md`` and
PNG plots. Rerunning with the same ``--out`` skips finished entries unless ``--force``. The folder
must be the bench's own (or new); it is locked while the bench runs (:func:`reasonkv.bench.store.claim_output`).

This module declares the arguments and turns them into a :class:`~reasonkv.bench.settings.BenchSettings`;
:func:`reasonkv.bench.run.run_bench` does the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from reasonkv.bench.run import run_bench
from reasonkv.bench.settings import DEFAULT_DTYPE, DEFAULT_LENGTHS, BenchSettings
from reasonkv.cli.args import (
    add_allocation_arguments,
    add_buffer_argument,
    add_model_arguments,
    add_policy_options,
    non_negative_argument,
)

__all__ = ["add_arguments", "run", "settings_from"]

# The flags' defaults are the settings' (lists as the comma-separated text the flags take).
D = {
    f.name: ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
    for f in dataclasses.fields(BenchSettings)
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = add_model_arguments(
        parser, dtype=DEFAULT_DTYPE, why="speed is measured in the dtype models are served in", shapes=True
    )
    model.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's own choice; recorded either way)",
    )

    policy = parser.add_argument_group("policies")
    policy.add_argument(
        "--policies",
        default=D["policies"],
        help="comma-separated policy names, or 'all' (default: every registered policy); full and streaming "
        "always run as references",
    )
    add_policy_options(policy)
    policy.add_argument(
        "--budget",
        type=int,
        default=D["budget"],
        help=f"K: tokens kept per head after an eviction (default {D['budget']})",
    )
    add_buffer_argument(policy)
    policy.add_argument("--seed", type=int, default=D["seed"], help="seeds the prompts and the policies (default 0)")
    policy.add_argument(
        "--quantized",
        type=non_negative_argument,
        default=0,
        metavar="Q",
        help="also measure every requested evicting policy with Q tokens per head kept quantized, its "
        "full-precision budget lowered so that its nominal K/V bytes equal the plain policy's at --budget "
        "(length sweep; default 0: no such variants)",
    )
    policy.add_argument(
        "--bits", type=int, choices=(4, 8), default=None, help="code width of the quantized tier (default 8)"
    )
    add_allocation_arguments(
        policy, what="; length sweep: every evicting entry runs under it, and the report shows its K/V bytes per layer"
    )

    sweep = parser.add_argument_group("length sweep")
    sweep.add_argument(
        "--lengths",
        default=None,
        help=f"lengths to report, strictly increasing (default {','.join(map(str, DEFAULT_LENGTHS))}; "
        "the sweep runs when this is given or when neither --max-batch nor --eviction-cost is)",
    )
    sweep.add_argument(
        "--no-reference-lengths",
        action="store_true",
        help="measure the --lengths only, not also K, K + B/2 and 8 K (what the summary's overhead and flatness "
        "compare with; then they compare with the nearest lengths measured)",
    )
    sweep.add_argument(
        "--rounds",
        type=int,
        default=D["rounds"],
        help="the sweep's entries of each batch size measured in this many interleaved rounds (A B C A B C ...), "
        f"each figure the median round's, the rounds' spread beside it (default {D['rounds']})",
    )
    sweep.add_argument(
        "--batch-sizes", default=D["batch_sizes"], help=f"comma-separated batch sizes (default {D['batch_sizes']})"
    )
    sweep.add_argument(
        "--prompt-length",
        type=int,
        default=D["prompt_length"],
        help="tokens of the fixed random prompt; prefills feed the rest as if generated "
        f"(default {D['prompt_length']})",
    )
    sweep.add_argument(
        "--window",
        type=int,
        default=None,
        help="decode steps per measurement window, ending at each length (default: the smallest multiple of "
        "--buffer >= 32, so every window holds whole eviction cycles; all decode steps with --prefill-to-length)",
    )
    sweep.add_argument(
        "--prefill-to-length",
        action="store_true",
        help="reach each length L by a prefill of L - n - 2 tokens (the --prompt-length prompt, then the rest "
        "as if generated), decode 2 untimed steps, then time n = --decode-steps steps ending at L: the prefill "
        "builds the cache at length L; an evicting policy is evicted to K by it (once, or after each "
        "--prefill-chunk once due) and measured in its steady state",
    )
    sweep.add_argument(
        "--transformers-cache",
        action="store_true",
        help="also measure transformers' own cache (the one model.generate builds, no reasonkv hook) as the "
        "entry 'transformers': full against it is what reasonkv's bookkeeping costs (needs --prefill-to-length)",
    )
    sweep.add_argument(
        "--decode-steps",
        type=int,
        default=D["decode_steps"],
        help=f"n: decode steps timed with --prefill-to-length and --max-batch (default {D['decode_steps']})",
    )
    sweep.add_argument(
        "--no-sync-timing",
        action="store_true",
        help="on CUDA, do not synchronise around each timed phase: step times unperturbed, but the phase "
        "split then covers kernel launches only",
    )
    sweep.add_argument(
        "--prefill-chunk",
        type=int,
        default=D["prefill_chunk"],
        help="most tokens per prefill forward, summed over the batch (default 0: one forward; an evicting "
        "policy evicts after each chunk once due)",
    )
    sweep.add_argument(
        "--ragged",
        action="store_true",
        help="also measure every requested evicting policy as 'POLICY~ragged' at each batch size above 1: its "
        "rows prefilled to lengths B / batch apart, so that they evict at different steps (as prompts of "
        "different lengths do), beside the rows that evict together (needs --prefill-to-length)",
    )

    sweep.add_argument(
        "--compile",
        nargs="?",
        const=True,
        default=False,
        metavar="BACKEND",
        help="also measure every policy as 'POLICY~compiled', its decode steps run as one compiled fixed-shape "
        "graph each (torch.compile; BACKEND: inductor, the default, or another torch.compile backend), and "
        "with --prefill-to-length plain transformers eager and compiled (a StaticCache and torch.compile of "
        "its forward) as 'transformers' and 'transformers~compiled'; compiling is timed apart, never in tok/s",
    )

    evict = parser.add_argument_group("eviction cost")
    evict.add_argument(
        "--eviction-cost", action="store_true", help="time one eviction per policy (batch 1, K = --cached - --buffer)"
    )
    evict.add_argument("--cached", type=int, default=None, help="N: tokens cached at each eviction (K = N - B)")
    evict.add_argument(
        "--repeats",
        type=int,
        default=D["repeats"],
        help=f"evictions timed per policy, after one warm-up (default {D['repeats']})",
    )

    batch = parser.add_argument_group("max batch")
    batch.add_argument("--max-batch", action="store_true", help="largest batch per policy within --memory-limit")
    batch.add_argument("--memory-limit", default=None, help="e.g. 24GiB, 48GB, 512MiB")
    batch.add_argument("--length", type=int, default=None, help="L: sequence length the batch must fit")
    batch.add_argument(
        "--probe-batches",
        default=D["probe_batches"],
        help=f"two batch sizes the memory overhead is measured at (default {D['probe_batches']})",
    )
    batch.add_argument(
        "--probe-steps",
        type=int,
        default=D["probe_steps"],
        help=f"decode steps of each probe (default {D['probe_steps']})",
    )
    batch.add_argument(
        "--max-measured-batch",
        type=int,
        default=D["max_measured_batch"],
        help=f"largest batch whose throughput is measured (default {D['max_measured_batch']})",
    )

    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, required=True, help="folder for results.jsonl, bench.json/md, PNGs")
    output.add_argument("--force", action="store_true", help="re-measure entries already in --out")
    output.add_argument("--no-progress", action="store_true", help="no progress bars")
    output.add_argument("--no-plots", action="store_true", help="no PNG plots (JSON and markdown only)")


def settings_from(args: argparse.Namespace) -> BenchSettings:
    """The settings the arguments describe (``ValueError`` for anything wrong, before any folder is touched)."""
    return BenchSettings(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attn=args.attn,
        threads=args.threads,
        policies=args.policies,
        option=args.option,
        budget=args.budget,
        buffer=args.buffer,
        seed=args.seed,
        quantized=args.quantized,
        bits=args.bits,
        allocation=args.allocation,
        budgets_file=args.budgets_file,
        adaptive_alpha=args.adaptive_alpha,
        padded_heads=args.padded_heads,
        lengths=args.lengths,
        reference_lengths=not args.no_reference_lengths,
        rounds=args.rounds,
        batch_sizes=args.batch_sizes,
        prompt_length=args.prompt_length,
        window=args.window,
        prefill_to_length=args.prefill_to_length,
        transformers_cache=args.transformers_cache,
        decode_steps=args.decode_steps,
        sync_timing=not args.no_sync_timing,
        prefill_chunk=args.prefill_chunk,
        ragged=args.ragged,
        compile=args.compile,
        eviction_cost=args.eviction_cost,
        cached=args.cached,
        repeats=args.repeats,
        max_batch=args.max_batch,
        memory_limit=args.memory_limit,
        length=args.length,
        probe_batches=args.probe_batches,
        probe_steps=args.probe_steps,
        max_measured_batch=args.max_measured_batch,
        out=args.out,
        force=args.force,
        progress=not args.no_progress,
        plots=not args.no_plots,
    )


def run(args: argparse.Namespace) -> int:
    return run_bench(settings_from(args))
