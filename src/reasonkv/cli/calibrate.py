"""``reasonkv calibrate``: find a model's EPIKV layer bands from counterfactual importance labels, or, with
``--centers``, write the query centers file TriAttention loads (``--out`` is then that file; the traces
come from ``--dataset`` / ``--traces`` / ``--max-trace-tokens``, or from a plain-text file, ``--text``;
:func:`reasonkv.calibrate.centers.run_centers`), or, with ``--gates``, train SeerAttention-R's gate on the
model's own answers to ``--gate-traces`` problems of ``--dataset`` and write ``gates.pt`` and ``gates.json``
into ``--out`` (:func:`reasonkv.calibrate.gates.run_gates`), or, with ``--budgets``, write the budget file of
``allocation="calibrated"`` (``--out`` is that file): each (layer, kv-head) weighted by the attention mass its
queries pay beyond ``--budget-sinks`` and the ``--budget-window`` most recent keys
(:func:`reasonkv.calibrate.budgets.run_budgets`).

Writes into ``--out``: ``labels.jsonl`` and ``signals.jsonl`` (one record per trace, appended as
they are computed: rerunning the same command resumes, and a larger ``--traces`` adds traces),
``calibration.json`` (the file EPIKV loads), ``correlation.png``, ``results.json`` (every number)
and ``summary.md``. The folder must be calibrate's own (or new, or free of these files); it is locked
while the command runs (:func:`reasonkv.calibrate.store.claim_output`).

This module declares the arguments and turns them into a
:class:`~reasonkv.calibrate.settings.CalibrateSettings`; :func:`reasonkv.calibrate.run.run_calibration`
does the rest.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reasonkv.calibrate.budgets import BudgetsSettings, run_budgets
from reasonkv.calibrate.centers import CentersSettings, run_centers
from reasonkv.calibrate.gates import GatesSettings, run_gates
from reasonkv.calibrate.labels import TARGETS, LabelSettings
from reasonkv.calibrate.pipeline import SIGNALS
from reasonkv.calibrate.profile import CONTROLS
from reasonkv.calibrate.run import run_calibration
from reasonkv.calibrate.settings import CalibrateSettings
from reasonkv.calibrate.signals import SignalSettings
from reasonkv.calibrate.traces import SOURCES
from reasonkv.cli.args import add_model_arguments

__all__ = ["add_arguments", "run", "settings_from"]

D = CalibrateSettings.defaults()  # the flags' defaults are the settings'


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "all") else _positive_int(text)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    data = parser.add_argument_group("traces")
    data.add_argument(
        "--dataset", default=D["dataset"], help=f"bundled dataset name or JSONL path (default {D['dataset']})"
    )
    data.add_argument(
        "--traces",
        type=_positive_int,
        default=D["traces"],
        help=f"number of problems, in file order (default {D['traces']})",
    )
    data.add_argument(
        "--source",
        choices=SOURCES,
        default=D["source"],
        help="teacher-force the reference solutions (default) or the model's own greedy answers",
    )
    data.add_argument(
        "--max-trace-tokens", type=_optional_int, default=D["max_trace_tokens"], help="cut traces to this many tokens"
    )
    data.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=D["max_new_tokens"],
        help="generation length for --source generated",
    )
    labels = parser.add_argument_group("labels")
    labels.add_argument(
        "--chunk-size",
        type=_positive_int,
        default=D["chunk_size"],
        help=f"tokens hidden at once (default {D['chunk_size']})",
    )
    labels.add_argument(
        "--horizon",
        type=_optional_int,
        default=D["horizon"],
        help="score only this many tokens after a chunk (default: all)",
    )
    labels.add_argument(
        "--batch-size",
        type=_positive_int,
        default=D["batch_size"],
        help=f"chunks hidden per forward (default {D['batch_size']})",
    )
    signals = parser.add_argument_group("signals")
    signals.add_argument(
        "--window", type=_positive_int, default=D["window"], help=f"EPIKV z-score window W (default {D['window']})"
    )
    signals.add_argument(
        "--query-window",
        type=_positive_int,
        default=D["query_window"],
        help=f"SnapKV window (default {D['query_window']})",
    )
    analysis = parser.add_argument_group("analysis")
    analysis.add_argument(
        "--target",
        choices=TARGETS,
        default=D["target"],
        help="label that picks the bands (default later: mean drop of the later tokens)",
    )
    analysis.add_argument("--signal", choices=SIGNALS, default=D["signal"], help="z-scored (default) or raw g")
    analysis.add_argument(
        "--control",
        choices=CONTROLS,
        default=D["control"],
        help="partial out the chunk position from the correlations (default) or not",
    )
    analysis.add_argument(
        "--min-width",
        type=_positive_int,
        default=D["min_width"],
        help=f"shortest band (default {D['min_width']} layers)",
    )
    analysis.add_argument(
        "--max-width", type=_positive_int, default=D["max_width"], help=f"widest band (default {D['max_width']} layers)"
    )
    analysis.add_argument(
        "--top-fraction",
        type=_fraction,
        default=D["top_fraction"],
        help=f"positives of the AUC (default {D['top_fraction']})",
    )
    analysis.add_argument(
        "--bootstrap", type=_positive_int, default=D["bootstrap"], help=f"trace resamples (default {D['bootstrap']})"
    )
    analysis.add_argument("--seed", type=int, default=D["seed"], help=f"bootstrap seed (default {D['seed']})")
    centers = parser.add_argument_group("query centers (TriAttention)")
    centers.add_argument(
        "--centers",
        action="store_true",
        help="write TriAttention's query centers of the model to the file --out instead of the layer anatomy",
    )
    centers.add_argument("--text", type=Path, help="with --centers: a plain-text file to read instead of --dataset")
    budgets = parser.add_argument_group("budgets per (layer, kv-head) (allocation='calibrated')")
    budgets.add_argument(
        "--budgets",
        action="store_true",
        help="write the budget file of --allocation calibrated (attention mass per head) to the file --out",
    )
    budgets.add_argument(
        "--budget-sinks", type=int, default=4, help="with --budgets: the streaming head's first keys (default 4)"
    )
    budgets.add_argument(
        "--budget-window",
        type=_positive_int,
        default=64,
        help="with --budgets: the streaming head's most recent keys (default 64)",
    )
    gates = parser.add_argument_group("gates (SeerAttention-R)")
    gates.add_argument(
        "--gates",
        action="store_true",
        help="train the seer policy's gate by self-distillation and write gates.pt into --out",
    )
    gates.add_argument(
        "--gate-traces", type=_positive_int, default=24, help="packed sequences to train on (default 24)"
    )
    gates.add_argument(
        "--held-out", type=int, default=4, help="further packed sequences to measure recall on (default 4)"
    )
    gates.add_argument(
        "--gate-steps", type=_positive_int, default=300, help="Adam steps, one sequence each (default 300)"
    )
    gates.add_argument(
        "--gate-temperature",
        type=float,
        default=0.6,
        help="sampling temperature of the model's answers (default 0.6, as the papers decode; 0: greedy)",
    )
    gates.add_argument(
        "--gate-pack",
        type=_positive_int,
        default=2048,
        help="answers are packed end to end into sequences of at least this many tokens (default 2048)",
    )
    gates.add_argument("--gate-batch", type=_positive_int, default=16, help="answers generated at a time (default 16)")
    gates.add_argument(
        "--gate-queries",
        type=_positive_int,
        default=128,
        help="query positions per packed sequence the loss is taken at (default 128)",
    )
    gates.add_argument(
        "--gate-dim", type=_positive_int, default=128, help="gate channels (default 128, the authors' width)"
    )
    gates.add_argument(
        "--gate-init",
        choices=("normal", "xavier"),
        default="normal",
        help="initial gate weights: normal (default: N(0, 0.02), the authors' training) or xavier (uniform)",
    )
    gates.add_argument(
        "--no-gate-norm",
        action="store_true",
        help="no RMSNorm on the gate's q and k (the authors' training turns it on, the default)",
    )
    gates.add_argument(
        "--gate-loss-everywhere",
        action="store_true",
        help="train on queries from each sequence's second block, not only its later half (the authors' choice)",
    )
    gates.add_argument("--block-size", type=_positive_int, default=64, help="tokens per block (default 64)")
    parser.add_argument(
        "--out", type=Path, required=True, help="output folder (reused to resume); a file with --centers"
    )
    parser.add_argument("--analyse-only", action="store_true", help="no model: analyse the records already in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _model(args: argparse.Namespace) -> dict:
    """The options every calibration shares: the model, how it loads, and the dataset it reads."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, attn=args.attn, dataset=args.dataset)


def _reading(args: argparse.Namespace) -> dict:
    """The options of a calibration that reads traces (:class:`~reasonkv.calibrate.reading.ReadingSettings`)."""
    return dict(
        **_model(args),
        traces=args.traces,
        text=args.text,
        max_tokens=args.max_trace_tokens,
        out=args.out,
    )


def settings_from(
    args: argparse.Namespace,
) -> CalibrateSettings | CentersSettings | GatesSettings | BudgetsSettings:
    """The settings the arguments describe (``ValueError`` for anything wrong, before any folder is touched)."""
    if getattr(args, "budgets", False):
        if args.analyse_only or args.centers or args.gates:
            raise ValueError(
                "--budgets writes a budget file; it does not combine with --analyse-only, --centers or --gates"
            )
        return BudgetsSettings(**_reading(args), sinks=args.budget_sinks, window=args.budget_window)
    if args.gates and (args.analyse_only or args.centers):
        raise ValueError("--gates trains a gate; it does not combine with --analyse-only or --centers")
    if args.centers:
        if args.analyse_only:
            raise ValueError("--analyse-only analyses anatomy records; --centers has none")
        return CentersSettings(**_reading(args))
    if args.text is not None:
        raise ValueError("--text is read by --centers and --budgets only (--gates and the anatomy read --dataset)")
    if args.gates:
        return GatesSettings(
            **_model(args),
            traces=args.gate_traces,
            held_out=args.held_out,
            max_new_tokens=args.max_new_tokens,
            block_size=args.block_size,
            temperature=args.gate_temperature,
            pack=args.gate_pack,
            batch=args.gate_batch,
            queries=args.gate_queries,
            gate_dim=args.gate_dim,
            qk_norm=not args.no_gate_norm,
            init=args.gate_init,
            later_half=not args.gate_loss_everywhere,
            steps=args.gate_steps,
            progress=not args.no_progress,
            out=args.out,
        )
    return CalibrateSettings(
        **_model(args),
        traces=args.traces,
        source=args.source,
        max_trace_tokens=args.max_trace_tokens,
        max_new_tokens=args.max_new_tokens,
        labels=LabelSettings(chunk_size=args.chunk_size, horizon=args.horizon, batch_size=args.batch_size),
        signals=SignalSettings(window=args.window, query_window=args.query_window),
        target=args.target,
        signal=args.signal,
        control=args.control,
        min_width=args.min_width,
        max_width=args.max_width,
        top_fraction=args.top_fraction,
        bootstrap=args.bootstrap,
        seed=args.seed,
        out=args.out,
        analyse_only=args.analyse_only,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if isinstance(settings, BudgetsSettings):
        return run_budgets(settings)
    if isinstance(settings, GatesSettings):
        return run_gates(settings)
    return run_centers(settings) if isinstance(settings, CentersSettings) else run_calibration(settings)
