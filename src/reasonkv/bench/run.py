"""One bench run: plan, claim the folder, load the model once, measure every pending entry, report.

:func:`run_bench` is the whole of ``reasonkv bench`` once its arguments are a
:class:`~reasonkv.bench.settings.BenchSettings`. Entries already in the folder are skipped (unless
``force``); each finished entry is appended to ``results.jsonl`` at once and the reports are rewritten,
so a killed run keeps its numbers. One failing entry is recorded as an error and the others still run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import sys
import time

import torch

from reasonkv.bench.eviction import measure_eviction_cost
from reasonkv.bench.machine import machine_info
from reasonkv.bench.maxbatch import measure_max_batch
from reasonkv.bench.measure import measure_prefilled_sweep, measure_sweep, model_dtype, warm_up
from reasonkv.bench.memory import kv_bytes_per_token, weight_bytes
from reasonkv.bench.plan import Plan, build_plan
from reasonkv.bench.plots import write_plots
from reasonkv.bench.report import markdown, summarise, summary_text
from reasonkv.bench.settings import EVICTION, SWEEP, BenchSettings
from reasonkv.bench.store import ResultStore, claim_output, entry_key, now_iso
from reasonkv.bench.tiers import equal_measured_bytes, tiered_budget
from reasonkv.hf import model_info
from reasonkv.models import load_model
from reasonkv.runs.outputs import write_atomic
from reasonkv.runs.store import json_safe

__all__ = ["measure_entry", "run_bench"]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_bench(settings: BenchSettings) -> int:
    """Measure what ``settings`` asks for into ``settings.out``; 0 when every entry succeeded, else 1."""
    plan = build_plan(settings)  # bad settings fail before the folder is touched
    with claim_output(settings.out):
        return _run(plan)


def _load(plan: Plan):
    s = plan.settings
    _say(f"loading {s.model} ({s.dtype}, {s.device}, {s.attn}) ...")
    try:
        model, _ = load_model(
            s.model, dtype=s.dtype, device=s.device, attn_implementation=s.attn, progress=None if s.progress else False
        )
    except (OSError, ImportError) as error:
        raise ValueError(f"cannot load model {s.model!r}: {error}") from None
    return model


def measure_entry(model, plan: Plan, mode: str, policy: str, batch: int | None, progress: bool) -> dict:
    """The numbers of one entry: ``policy`` (an entry of the plan) in ``mode`` at ``batch`` rows."""
    config = plan.configs[mode]
    spec = plan.specs[mode][policy]
    variant = plan.tiers.get(policy)
    common = dict(prompt_length=config["prompt_length"], seed=config["seed"])
    if variant is not None:  # a tiered variant: the policy with a quantized tier, at the plain K/V bytes measured
        tier = tiered_budget(model, spec.budget, variant["quantized"], variant["bits"])
        tier = equal_measured_bytes(
            model, spec, tier, batch=batch, prefill_chunk=config.get("prefill_chunk", 0), **common
        )
        spec = spec.replace(budget=tier["budget"], quantized=tier["quantized"], bits=tier["bits"])
    if mode == SWEEP:
        common.update(
            batch=batch,
            lengths=plan.sweep_lengths(policy),
            window=config["window"],
            progress=progress,
            sync_timing=config["sync_timing"],
            compile=config["compile"] if policy in plan.compiled else None,
        )
        if config["prefill_to_length"]:
            ragged = policy in plan.ragged
            data = measure_prefilled_sweep(
                model,
                spec,
                decode_steps=config["decode_steps"],
                prefill_chunk=config["prefill_chunk"],
                ragged=ragged,
                **common,
            )
        else:
            data = measure_sweep(model, spec, **common)
        if variant is not None:
            data["tier"] = {"policy": variant["policy"], **tier}
        return data
    if mode == EVICTION:
        return measure_eviction_cost(
            model, spec, repeats=config["repeats"], batch=batch, prefill_chunk=config["prefill_chunk"], **common
        )
    return measure_max_batch(
        model,
        spec,
        length=config["length"],
        memory_limit=config["memory_limit_bytes"],
        decode_steps=config["decode_steps"],
        probe_batches=tuple(config["probe_batches"]),
        probe_steps=config["probe_steps"],
        max_measured_batch=config["max_measured_batch"],
        prefill_chunk=config["prefill_chunk"],
        **common,
    )


def _reads_attention(model, plan: Plan) -> dict[str, bool]:
    """Whether each entry's policy reads attention (records queries through the attention tap)."""
    info = model_info(model)
    return {name: policy is not None and policy.needs(info).taps_attention for name, policy in plan.instances.items()}


def _headline(mode: str, data: dict) -> str:
    if mode == SWEEP:
        last = max(data["windows"], key=lambda w: w["length"])
        return f"{last['tokens_per_s']:.1f} tok/s, {1000 * last['step_mean_s']:.2f} ms/step at {last['length']}"
    if mode == EVICTION:
        return f"{1000 * data['mean_s']:.3f} ms per eviction"
    tps = data.get("tokens_per_s")
    return f"fits {data['max_batch']} rows; {'-' if tps is None else f'{tps:.1f}'} tok/s at {data['measured_batch']}"


def _write_reports(store: ResultStore, meta: dict, *, plots: bool) -> None:
    records = store.ok()
    summary = summarise(records)
    document = json_safe({**meta, "records": records, "summary": summary})
    write_atomic(store.out / "bench.json", json.dumps(document, indent=1, allow_nan=False) + "\n")
    write_atomic(store.out / "bench.md", markdown(records, summary, meta))
    if plots and records:
        try:
            write_plots(records, store.out, device=meta.get("device", "cpu"))
        except ImportError:  # matplotlib, imported by the plots only
            _say("matplotlib is not installed: no plots (pip install matplotlib)")


def _print_summary(store: ResultStore, meta: dict) -> None:
    records = store.ok()
    text = summary_text(records, summarise(records), meta)
    if text.strip():
        print(text)
    print(f"results in {store.out}/ (bench.md, bench.json, results.jsonl, *.png)")
    sys.stdout.flush()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _plan_line(plan: Plan, pending: list[tuple[str, str, int | None]]) -> str:
    """What this run will measure, said before the first entry (its time follows each entry)."""
    modes = {mode: sum(1 for m, _, _ in pending if m == mode) for mode in plan.modes}
    parts = [f"{count} {mode} entr{'y' if count == 1 else 'ies'}" for mode, count in modes.items() if count]
    text = f"bench: {', '.join(parts)}"
    if modes.get(SWEEP):
        config = plan.configs[SWEEP]
        text += (
            f" (the sweep up to {max(config['lengths'])} tokens, batch sizes {', '.join(map(str, plan.batch_sizes))})"
        )
    return text + "; the time left is estimated after each entry"


def _time_left(took: dict[str, list[float]], rest: list[str]) -> str:
    """``about N min left``: the entries still to measure, each at the mean time of its mode's finished ones."""
    if not rest:
        return ""
    means = {mode: sum(times) / len(times) for mode, times in took.items()}
    known = [means[mode] for mode in rest if mode in means]
    if len(known) < len(rest):  # a mode not measured yet: no estimate for it
        return f"{len(rest)} entries left"
    seconds = sum(known)
    when = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return f"{len(rest)} entries left, about {when} at the mean time of the entries so far"


def _run(plan: Plan) -> int:
    settings = plan.settings
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    for warning in plan.warnings:
        _say(f"warning: {warning}")
    store = ResultStore(settings.out)
    entries = plan.entries()
    for mode in plan.modes:
        rerun = [entry_key(m, p, b, plan.options[p]) for m, p, b in entries if m == mode]
        dropped = store.check_config(mode, plan.configs[mode], force=settings.force, rerun=rerun)
        if dropped:
            _say(f"--force: dropped {dropped} earlier {mode} record(s)")
    pending = [e for e in entries if not store.done(e[0], e[1], e[2], plan.options[e[1]])]
    if len(pending) < len(entries):
        _say(f"{len(entries) - len(pending)} of {len(entries)} entries already in {settings.out}: skipped")
    progress = settings.progress and sys.stderr.isatty()
    device = torch.device(settings.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    previous = store.ok()
    meta = {
        "format": 1,
        "command": settings.command(),
        "argv": list(sys.argv),
        "arguments": settings.arguments(),
        "date": now_iso(),
        "model": settings.model,
        "dtype": settings.dtype,
        "device": settings.device,
        "attn": settings.attn,
        "machine": machine_info(device),
        "weight_bytes": previous[-1].get("weight_bytes") if previous else None,
        "kv_bytes_per_token": previous[-1].get("kv_bytes_per_token") if previous else None,
        "configs": plan.configs,
        "errors": [],
    }
    if not pending:
        _write_reports(store, meta, plots=settings.plots)
        _print_summary(store, meta)
        return 0

    model = _load(plan)
    reads = _reads_attention(model, plan)
    meta["weight_bytes"] = weight_bytes(model)
    meta["kv_bytes_per_token"] = kv_bytes_per_token(model, model_dtype(model))
    warm_up(model)
    _say(_plan_line(plan, pending))
    took: dict[str, list[float]] = {}  # mode -> seconds of its finished entries
    previous_handler = None
    with contextlib.suppress(ValueError):  # not the main thread: no handler, SIGTERM just kills
        previous_handler = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for index, (mode, policy, batch) in enumerate(pending, 1):
            label = f"{mode} {policy}" + ("" if batch is None else f" batch {batch}")
            _say(f"[{index}/{len(pending)}] {label} ...")
            start = time.perf_counter()
            record = {
                "mode": mode,
                "policy": policy,
                "batch": batch,
                "options": plan.options[policy],
                "evicts": plan.evicts[policy],
                "reads_attention": reads[policy],
                "config": plan.configs[mode],
                "date": now_iso(),
                "machine": {k: meta["machine"][k] for k in ("cpu", "gpu", "torch", "transformers")},
                "weight_bytes": meta["weight_bytes"],
            }
            try:
                data = measure_entry(model, plan, mode, policy, batch, progress)
            except KeyboardInterrupt:
                raise
            except Exception as error:  # one failing policy must not cost the others their numbers
                message = f"{type(error).__name__}: {error}"
                _say(f"    failed: {message}")
                store.add({**record, "status": "error", "error": message})
                meta["errors"].append({"mode": mode, "policy": policy, "batch": batch, "error": message})
            else:
                record.update(data)
                record.update(status="ok", seconds=time.perf_counter() - start)
                store.add(record)
                _say(f"    {_headline(mode, data)} ({time.perf_counter() - start:.0f} s)")
                took.setdefault(mode, []).append(time.perf_counter() - start)
                left = _time_left(took, [m for m, _, _ in pending[index:]])
                if left:
                    _say(f"    {left}")
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            _write_reports(store, meta, plots=False)
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        _write_reports(store, meta, plots=settings.plots)
    _print_summary(store, meta)
    return 1 if meta["errors"] else 0
