"""``reasonkv calibrate``: find a model's EPIKV layer bands from counterfactual importance labels.

Writes into ``--out``: ``labels.jsonl`` and ``signals.jsonl`` (one record per trace, appended as
they are computed: rerunning the same command resumes, and a larger ``--traces`` adds traces),
``calibration.json`` (the file EPIKV loads), ``correlation.png``, ``results.json`` (every number)
and ``summary.md``. The folder must be calibrate's own (or new, or free of these files); it is locked
while the command runs (:func:`reasonkv.calibrate.store.claim_output`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from reasonkv.cli.args import add_model_arguments

__all__ = ["add_arguments", "run"]


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
    data.add_argument("--dataset", default="gsm8k", help="bundled dataset name or JSONL path (default gsm8k)")
    data.add_argument(
        "--traces", type=_positive_int, default=100, help="number of problems, in file order (default 100)"
    )
    data.add_argument(
        "--source",
        choices=("reference", "generated"),
        default="reference",
        help="teacher-force the reference solutions (default) or the model's own greedy answers",
    )
    data.add_argument("--max-trace-tokens", type=_optional_int, default=None, help="cut traces to this many tokens")
    data.add_argument(
        "--max-new-tokens", type=_positive_int, default=512, help="generation length for --source generated"
    )
    labels = parser.add_argument_group("labels")
    labels.add_argument("--chunk-size", type=_positive_int, default=8, help="tokens hidden at once (default 8)")
    labels.add_argument(
        "--horizon", type=_optional_int, default=None, help="score only this many tokens after a chunk (default: all)"
    )
    labels.add_argument("--batch-size", type=_positive_int, default=8, help="chunks hidden per forward (default 8)")
    signals = parser.add_argument_group("signals")
    signals.add_argument("--window", type=_positive_int, default=128, help="EPIKV z-score window W (default 128)")
    signals.add_argument("--query-window", type=_positive_int, default=32, help="SnapKV window (default 32)")
    analysis = parser.add_argument_group("analysis")
    analysis.add_argument(
        "--target",
        choices=("later", "later_sum", "answer"),
        default="later",
        help="label that picks the bands (default later: mean drop of the later tokens)",
    )
    analysis.add_argument("--signal", choices=("z", "g"), default="z", help="z-scored (default) or raw g")
    analysis.add_argument(
        "--control",
        choices=("position", "none"),
        default="position",
        help="partial out the chunk position from the correlations (default) or not",
    )
    analysis.add_argument("--min-width", type=_positive_int, default=3, help="shortest band (default 3 layers)")
    analysis.add_argument("--max-width", type=_positive_int, default=8, help="widest band (default 8 layers)")
    analysis.add_argument("--top-fraction", type=_fraction, default=0.2, help="positives of the AUC (default 0.2)")
    analysis.add_argument("--bootstrap", type=_positive_int, default=1000, help="trace resamples (default 1000)")
    analysis.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (reused to resume)")
    parser.add_argument("--analyse-only", action="store_true", help="no model: analyse the records already in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _command(args: argparse.Namespace) -> str:
    parts = ["reasonkv", "calibrate", "--model", str(args.model), "--dataset", str(args.dataset)]
    parts += ["--traces", str(args.traces), "--source", args.source, "--chunk-size", str(args.chunk_size)]
    optional = {
        "--dtype": (args.dtype, "fp32"),
        "--device": (args.device, "cpu"),
        "--horizon": (args.horizon, None),
        "--max-trace-tokens": (args.max_trace_tokens, None),
        "--target": (args.target, "later"),
        "--signal": (args.signal, "z"),
        "--control": (args.control, "position"),
        "--window": (args.window, 128),
        "--batch-size": (args.batch_size, 8),
        "--bootstrap": (args.bootstrap, 1000),
    }
    for flag, (value, default) in optional.items():
        if value != default:
            parts += [flag, str(value)]
    if args.source == "generated":
        parts += ["--max-new-tokens", str(args.max_new_tokens)]
    return shlex.join([*parts, "--out", str(args.out)])


def _problems(args: argparse.Namespace):
    from reasonkv.eval.datasets import load_dataset

    problems = load_dataset(args.dataset)
    if args.source == "reference":
        problems = [p for p in problems if p.solution]
        if not problems:
            raise ValueError(f"dataset {args.dataset!r} has no reference solutions; use --source generated")
    if len(problems) < args.traces:
        print(f"calibrate: only {len(problems)} usable problems in {args.dataset}", file=sys.stderr)
    return problems[: args.traces]


def run(args: argparse.Namespace) -> int:
    from reasonkv.calibrate.store import claim_output

    if args.min_width > args.max_width:
        raise ValueError(f"--min-width {args.min_width} is larger than --max-width {args.max_width}")
    with claim_output(args.out, inputs=[args.dataset]):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from reasonkv.calibrate.bands import write_band_calibration
    from reasonkv.calibrate.labels import LabelSettings
    from reasonkv.calibrate.pipeline import analyse, auc_for, collect, open_stores
    from reasonkv.calibrate.signals import SignalSettings
    from reasonkv.calibrate.summary import render_summary
    from reasonkv.policies.calibration import default_anatomy

    label_settings = LabelSettings(chunk_size=args.chunk_size, horizon=args.horizon, batch_size=args.batch_size)
    signal_settings = SignalSettings(window=args.window, query_window=args.query_window)
    run_settings = {
        "model": str(args.model),
        "dtype": args.dtype,
        "dataset": str(args.dataset),
        "source": args.source,
        "max_trace_tokens": args.max_trace_tokens,
        "max_new_tokens": args.max_new_tokens if args.source == "generated" else None,
    }
    problems = _problems(args)
    out: Path = args.out
    label_store, signal_store = open_stores(out, run_settings, label_settings, signal_settings)
    ids = [p.id for p in problems]
    if args.analyse_only:
        print(f"calibrate: analysing {len(ids)} traces in {out}", file=sys.stderr)
    else:
        todo = sum(1 for i in ids if i not in label_store or i not in signal_store)
        print(f"calibrate: {len(ids) - todo} of {len(ids)} traces already in {out}", file=sys.stderr)
        if todo:
            from reasonkv.cli.args import load_model_from

            model, tokenizer = load_model_from(args)
            collect(
                model,
                tokenizer,
                problems,
                label_store,
                signal_store,
                labels=label_settings,
                signals=signal_settings,
                source=args.source,
                max_trace_tokens=args.max_trace_tokens,
                max_new_tokens=args.max_new_tokens,
                progress=not args.no_progress,
            )

    analysis = analyse(
        label_store,
        signal_store,
        ids,
        signal=args.signal,
        target=args.target,
        control=args.control,
        min_width=args.min_width,
        max_width=args.max_width,
        replicates=args.bootstrap,
        seed=args.seed,
    )
    main = analysis.profiles[(args.signal, args.target)]
    calibration = write_band_calibration(
        out / "calibration.json",
        model=str(args.model),
        profile=main,
        band_a=analysis.band_a,
        band_b=analysis.band_b,
        extra={
            "dataset": str(args.dataset),
            "source": args.source,
            "chunk_size": args.chunk_size,
            "control": args.control,
        },
        min_width=args.min_width,
    )
    default = default_anatomy(analysis.num_layers)
    auc_for(
        analysis,
        label_store,
        signal_store,
        ids,
        {"default": default, "cal": calibration},
        targets=list(dict.fromkeys([args.target, "answer"])),
        fraction=args.top_fraction,
        replicates=args.bootstrap,
        seed=args.seed,
    )

    plot_file: str | None = "correlation.png"
    try:
        from reasonkv.calibrate.plot import plot_profiles

        targets = list(dict.fromkeys([args.target, "answer"]))
        plot_profiles(
            out / plot_file,
            [[analysis.profiles[(s, t)] for s in ("z", "g")] for t in targets],
            band_a=analysis.band_a,
            band_b=analysis.band_b,
            default_a=default.band_a,
            default_b=default.band_b,
            title=f"{args.model}: layer anatomy on {args.dataset} ({analysis.traces} traces)",
        )
    except ImportError:
        plot_file = None
        print("calibrate: matplotlib is not installed; no plot (pip install matplotlib)", file=sys.stderr)

    run_info = {
        "model": str(args.model),
        "dataset": str(args.dataset),
        "source": args.source,
        "chunk_size": args.chunk_size,
        "horizon": args.horizon,
        "replicates": args.bootstrap,
        "fraction": args.top_fraction,
        "min_width": args.min_width,
        "max_width": args.max_width,
        "command": _command(args),
    }
    summary = render_summary(analysis, calibration=calibration, default=default, run=run_info, plot_file=plot_file)
    (out / "summary.md").write_text(summary, encoding="utf-8")
    results = {
        "run": run_info,
        "traces": analysis.traces,
        "chunks": analysis.chunks,
        "seconds_per_trace": round(analysis.seconds_per_trace, 3),
        "cpu_seconds_per_trace": round(analysis.cpu_seconds_per_trace, 3),
        "label_position_rho": analysis.label_position,
        "calibration": {k: v for k, v in calibration.as_dict().items() if k != "profile"},
        "bands": {
            name: None
            if band is None
            else {
                "layers": list(band.layers),
                "representative": band.representative,
                "rho": band.rho,
                "low": band.low,
                "high": band.high,
            }
            for name, band in (("a", analysis.band_a), ("b", analysis.band_b))
        },
        "profiles": [p.to_dict() for p in analysis.profiles.values()],
        "auc": {t: [row.to_dict() for row in rows] for t, rows in analysis.auc.items()},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    found = [
        f"band {n}: {b.first}..{b.last} ({n.lower()} = {b.representative})"
        for n, b in (("A", analysis.band_a), ("B", analysis.band_b))
        if b is not None
    ]
    print(f"calibrate: {'; '.join(found) or 'no band found'}; wrote {out}/summary.md", file=sys.stderr)
    return 0
