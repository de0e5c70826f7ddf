"""Collect the per-trace records (labels, signals) into resumable files (:func:`collect`: one line per trace to
``labels.jsonl`` and ``signals.jsonl``, the traces already there skipped), then analyse them without a model
(:func:`analyse`: the profiles and the bands; :func:`auc_for`: the AUC tables)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from reasonkv.calibrate.auc import AucRow, auc_table
from reasonkv.calibrate.bands import Band, discover_bands
from reasonkv.calibrate.labels import TARGETS, label_trace
from reasonkv.calibrate.profile import Profile, layer_profile
from reasonkv.calibrate.scores import chunk_scores
from reasonkv.calibrate.signals import SIGNALS, trace_signals
from reasonkv.calibrate.stats import spearman
from reasonkv.calibrate.store import RecordStore
from reasonkv.calibrate.traces import generated_trace, reference_trace

if TYPE_CHECKING:
    from reasonkv.calibrate.settings import CalibrateSettings

__all__ = ["LABELS_FILE", "SIGNALS_FILE", "Analysis", "analyse", "auc_for", "collect", "open_stores"]

LABELS_FILE = "labels.jsonl"
SIGNALS_FILE = "signals.jsonl"


def open_stores(settings: CalibrateSettings) -> tuple[RecordStore, RecordStore]:
    """The label store (refuses other settings) and the signal store (recomputed when they change) in ``out``."""
    label_settings = {**settings.record_settings(), **settings.labels.record_settings()}
    label_store = RecordStore(settings.out / LABELS_FILE, label_settings, on_mismatch="error")
    signal_settings = {**label_settings, **asdict(settings.signals)}  # every signal setting changes the signals
    return label_store, RecordStore(settings.out / SIGNALS_FILE, signal_settings, on_mismatch="replace")


def collect(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Any],
    label_store: RecordStore,
    signal_store: RecordStore,
    settings: CalibrateSettings,
) -> list[str]:
    """Label and record every problem not yet in the stores (traces, labels and signals as ``settings`` say);
    returns the ids in problem order."""
    from tqdm.auto import tqdm

    ids = []
    bar = tqdm(problems, desc="calibrate", unit="trace", disable=not settings.progress)
    for problem in bar:
        ids.append(problem.id)
        if problem.id in label_store and problem.id in signal_store:
            continue
        if problem.id not in label_store:
            started, cpu = time.perf_counter(), time.process_time()
            if settings.source == "reference":
                trace = reference_trace(tokenizer, problem, max_tokens=settings.max_trace_tokens)
            else:
                trace = generated_trace(model, tokenizer, problem, max_new_tokens=settings.max_new_tokens)
            result = label_trace(model, trace, settings.labels)
            label_store.append(
                {
                    "id": trace.id,
                    "source": trace.source,
                    "prompt_length": trace.prompt_length,
                    "ids": trace.ids,
                    "text": trace.text,
                    **result,
                    "seconds": time.perf_counter() - started,
                    "cpu_seconds": time.process_time() - cpu,
                }
            )
        record = label_store.records[problem.id]
        cpu = time.process_time()
        result = trace_signals(model, record["ids"], record["chunks"], settings.signals, seed_key=problem.id)
        signal_store.append({"id": problem.id, **result, "cpu_seconds": time.process_time() - cpu})
        bar.set_postfix(chunks=len(record["chunks"]), tokens=len(record["ids"]))
    return ids


@dataclass
class Analysis:
    """Everything the outputs are made from."""

    traces: int
    chunks: int
    profiles: dict[tuple[str, str], Profile]  # (signal, target) -> profile
    main: Profile  # the (signal, target) profile the bands were picked by, under the run's control
    band_a: Band | None
    band_b: Band | None
    label_position: dict[str, float]  # target -> mean per-trace Spearman of the labels with chunk index
    auc: dict[str, list[AucRow]] = field(default_factory=dict)  # target -> rows
    seconds_per_trace: float = float("nan")
    cpu_seconds_per_trace: float = float("nan")


def analyse(
    label_store: RecordStore, signal_store: RecordStore, ids: Sequence[str], settings: CalibrateSettings
) -> Analysis:
    """Profiles for every signal x label kind and the bands of ``(signal, target)``, as ``settings`` say; the
    AUC tables need the calibrated layers: :func:`auc_for` adds them once they are chosen."""
    s = settings
    missing = [i for i in ids if i not in label_store or i not in signal_store]
    if missing:
        raise ValueError(f"{len(missing)} traces have no records yet (first: {missing[0]!r})")
    if not ids:
        raise ValueError("no traces to analyse")
    label_records = [label_store.records[i] for i in ids]
    signal_records = [signal_store.records[i] for i in ids]
    profiles = {}
    for kind in SIGNALS:
        for label_kind in TARGETS:
            signals = [np.asarray(s[kind], dtype=float) for s in signal_records]
            labels = [np.asarray(r["labels"][label_kind], dtype=float) for r in label_records]
            profiles[(kind, label_kind)] = layer_profile(
                signals, labels, signal=kind, target=label_kind, control=s.control, replicates=s.bootstrap, seed=s.seed
            )
    label_position = {}
    for label_kind in TARGETS:
        rhos = [spearman(np.arange(len(r["chunks"])), r["labels"][label_kind]) for r in label_records]
        label_position[label_kind] = float(np.nanmean(rhos)) if not np.isnan(rhos).all() else float("nan")
    main = profiles[(s.signal, s.target)]
    band_a, band_b = discover_bands(main, min_width=s.min_width, max_width=s.max_width)
    return Analysis(
        traces=len(ids),
        chunks=sum(len(r["chunks"]) for r in label_records),
        profiles=profiles,
        main=main,
        band_a=band_a,
        band_b=band_b,
        label_position=label_position,
        seconds_per_trace=_mean(label_records, "seconds") + _mean(signal_records, "seconds"),
        cpu_seconds_per_trace=_mean(label_records, "cpu_seconds") + _mean(signal_records, "cpu_seconds"),
    )


def _mean(records: Sequence[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return float(np.mean(values)) if values else float("nan")


def auc_for(
    analysis: Analysis,
    label_store: RecordStore,
    signal_store: RecordStore,
    ids: Sequence[str],
    calibrations: dict[str, Any],
    settings: CalibrateSettings,
) -> dict[str, list[AucRow]]:
    """AUC tables per label kind reported for every score, EPIKV scored with each of ``calibrations`` (the
    positives, resamples and seed as ``settings`` say)."""
    s = settings
    scores = [chunk_scores(signal_store.records[i], calibrations) for i in ids]
    tables = {}
    for target in s.targets:
        labels = [np.asarray(label_store.records[i]["labels"][target], dtype=float) for i in ids]
        tables[target] = auc_table(scores, labels, fraction=s.top_fraction, replicates=s.bootstrap, seed=s.seed)
    analysis.auc = tables
    return tables
