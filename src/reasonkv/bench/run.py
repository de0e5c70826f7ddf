"""One bench run: plan, claim the folder, load the model once, measure every pending entry, report.

Entries already in the folder are skipped (unless ``force``). After a warm-up, the length sweep's entries of
one batch size are measured in interleaved rounds (:mod:`reasonkv.bench.rounds`); the other measurements run
once each. Each finished entry is appended to ``results.jsonl`` at once and the reports are rewritten; a killed
run keeps every finished entry, and those with some rounds measured (``rounds_complete: false``). A failing
entry is recorded as an error and the others still run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import torch

from reasonkv.bench.eviction import measure_eviction_cost
from reasonkv.bench.machine import machine_info
from reasonkv.bench.maxbatch import measure_max_batch
from reasonkv.bench.measure import free_memory, measure_sweep, model_dtype
from reasonkv.bench.memory import kv_bytes_per_token, weight_bytes
from reasonkv.bench.plan import Plan, build_plan
from reasonkv.bench.plots import write_plots
from reasonkv.bench.prefilled import measure_prefilled_sweep
from reasonkv.bench.report import markdown, summarise, summary_text
from reasonkv.bench.rounds import combine_rounds, run_rounds
from reasonkv.bench.settings import EVICTION, SWEEP, BenchSettings
from reasonkv.bench.store import ResultStore, claim_output, entry_key, now_iso
from reasonkv.bench.tiers import equal_measured_bytes, tiered_budget
from reasonkv.bench.warmup import warm_up
from reasonkv.cache import EvictingCache
from reasonkv.cache.allocation import Uniform
from reasonkv.hf import model_info
from reasonkv.models import load_model
from reasonkv.runs.outputs import write_atomic
from reasonkv.runs.paths import command_line, portable_command, portable_path
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
            prefill = {key: config[key] for key in ("decode_steps", "prefill_chunk")}
            data = measure_prefilled_sweep(model, spec, ragged=policy in plan.ragged, **prefill, **common)
        else:
            data = measure_sweep(model, spec, **common)
        if variant is not None:
            data["tier"] = {"policy": variant["policy"], **tier}
        return data
    if mode == EVICTION:
        return measure_eviction_cost(
            model, spec, repeats=config["repeats"], batch=batch, prefill_chunk=config["prefill_chunk"], **common
        )
    sizes = ("length", "decode_steps", "probe_steps", "max_measured_batch", "prefill_chunk")
    return measure_max_batch(
        model,
        spec,
        memory_limit=config["memory_limit_bytes"],
        probe_batches=tuple(config["probe_batches"]),
        **{key: config[key] for key in sizes},
        **common,
    )


def _allocation_of(plan: Plan, mode: str, policy: str) -> dict:
    """``{"allocation": name}`` for an entry of a run under an allocation (``uniform`` for the full cache, which
    evicts nothing to share); nothing otherwise."""
    if not plan.settings.allocation_rule.per_head:
        return {}
    spec = plan.specs[mode].get(policy)
    return {"allocation": Uniform.name if spec is None else spec.allocation}


def check_allocation_fits(model, plan: Plan) -> None:
    """Build (and drop) the cache of one evicting entry under the allocation, so that what the cache refuses on
    this model (a budget file for another number of evicting layers or kv-heads, an attention kernel without
    per-head masks) is one error before anything is measured."""
    spec = next((s for s in plan.specs.get(SWEEP, {}).values() if s is not None and s.allocated), None)
    if spec is None:
        return
    try:
        cache = EvictingCache(model=model, spec=spec)
    except ValueError as error:
        raise ValueError(f"--allocation {plan.settings.allocation}: {error}") from None
    cache.detach()


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


def _write_reports(store: ResultStore, meta: dict, *, plots: bool) -> str:
    """Rewrite the folder's reports; the summary the command prints at the end."""
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
    return summary_text(records, summary, meta)


def _print_summary(store: ResultStore, text: str) -> None:
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
        batches = ", ".join(map(str, plan.batch_sizes))
        text += f" (the sweep up to {max(plan.configs[SWEEP]['lengths'])} tokens, batch sizes {batches})"
    return text + "; the time left is estimated after each entry"


def _time_left(took: dict[str, list[float]], rest: list[str]) -> str:
    """``about N min left``: the entry rounds still to measure, each at the mean time of its mode's finished ones."""
    if not rest:
        return ""
    means = {mode: sum(times) / len(times) for mode, times in took.items()}
    known = [means[mode] for mode in rest if mode in means]
    if len(known) < len(rest):  # a mode not measured yet: no estimate for it
        return f"{len(rest)} entry rounds left"
    seconds = sum(known)
    when = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return f"{len(rest)} entry rounds left, about {when} at the mean time of those so far"


def _groups(plan: Plan, pending: list[tuple[str, str, int | None]]) -> list[tuple[int, list[tuple]]]:
    """``(rounds, entries)`` in measuring order: the sweep's entries of each batch size together, in
    ``--rounds`` interleaved rounds; every other entry alone, once."""
    groups: list[tuple[int, list[tuple]]] = []
    sweeps: dict[int | None, list[tuple]] = {}
    for entry in pending:
        mode, _, batch = entry
        if mode != SWEEP:
            groups.append((1, [entry]))
        elif batch in sweeps:
            sweeps[batch].append(entry)
        else:
            sweeps[batch] = [entry]
            groups.append((plan.settings.rounds, sweeps[batch]))
    return groups


def _command(settings: BenchSettings) -> dict:
    """How ``bench.json`` records the command: every setting spelled out, the arguments as typed and as parsed;
    never the launcher's path, and paths as the run's folder names them (``bench.json`` is committed and read
    on other machines)."""
    arguments = settings.arguments()
    for name in ("model", "out", "budgets_file"):
        if isinstance(arguments.get(name), str):
            arguments[name] = portable_path(arguments[name], settings.out)
    return {
        "command": portable_command(settings.command(), settings.out),
        "argv": command_line(settings.out),
        "arguments": arguments,
    }


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
        **_command(settings),
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
        _print_summary(store, _write_reports(store, meta, plots=settings.plots))
        return 0

    model = _load(plan)
    check_allocation_fits(model, plan)
    reads = _reads_attention(model, plan)
    meta["weight_bytes"] = weight_bytes(model)
    meta["kv_bytes_per_token"] = kv_bytes_per_token(model, model_dtype(model))
    settled = warm_up(model)
    meta["warm_up"] = settled
    state = "stable" if settled["stable"] else "not stable within its cap"
    _say(f"warm-up: {settled['steps']} decode steps, step time {state}")
    _say(_plan_line(plan, pending))
    groups = _groups(plan, pending)
    queue = [entry[0] for rounds, group in groups for _ in range(rounds) for entry in group]
    took: dict[str, list[float]] = {}  # mode -> seconds of its finished entry rounds
    done = [0]  # entry rounds measured (or failed) so far
    run_id = f"{meta['date']}/{os.getpid()}"

    def base(mode: str, policy: str, batch: int | None) -> dict:
        return {
            "mode": mode,
            "policy": policy,
            "batch": batch,
            "options": plan.options[policy],
            "evicts": plan.evicts[policy],
            "selects": plan.selects[policy],
            **_allocation_of(plan, mode, policy),
            "reads_attention": reads[policy],
            "config": plan.configs[mode],
            "date": now_iso(),
            "machine": {k: meta["machine"][k] for k in ("cpu", "gpu", "torch", "transformers")},
            "weight_bytes": meta["weight_bytes"],
        }

    def measure(entry: tuple, round_index: int, rounds: int) -> dict:
        mode, policy, batch = entry
        label = f"{mode} {policy}" + ("" if batch is None else f" batch {batch}")
        if rounds > 1:
            label += f" (round {round_index + 1} of {rounds})"
        done[0] += 1
        _say(f"[{done[0]}/{len(queue)}] {label} ...")
        start = time.perf_counter()
        try:
            data = measure_entry(model, plan, mode, policy, batch, progress)
        finally:
            free_memory(device)
        seconds = time.perf_counter() - start
        _say(f"    {_headline(mode, data)} ({seconds:.0f} s)")
        took.setdefault(mode, []).append(seconds)
        left = _time_left(took, queue[done[0] :])
        if left:
            _say(f"    {left}")
        return {**data, "seconds": seconds}

    def record_of(entry: tuple, datas: list[dict], rounds: int, group: str | None) -> dict:
        mode, policy, batch = entry
        record = base(mode, policy, batch)
        record.update(combine_rounds(datas) if mode == SWEEP else datas[0])
        record.update(status="ok", seconds=sum(d["seconds"] for d in datas))
        if group is not None:
            record.update(rounds_group=group, rounds=len(datas), rounds_complete=len(datas) == rounds)
        return record

    previous_handler = None
    with contextlib.suppress(ValueError):  # not the main thread: no handler, SIGTERM just kills
        previous_handler = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for rounds, group in groups:
            mode, _, batch = group[0]
            group_id = f"{run_id}/{mode}/batch {batch}" if mode == SWEEP else None
            collected: dict[tuple, list[dict]] = {}

            def finish(entry: tuple, datas: list[dict], rounds=rounds, group_id=group_id) -> None:
                store.add(record_of(entry, datas, rounds, group_id))
                _write_reports(store, meta, plots=False)

            def failed(entry: tuple, error: Exception) -> None:
                mode, policy, batch = entry
                message = f"{type(error).__name__}: {error}"
                _say(f"    failed: {message}")
                store.add({**base(mode, policy, batch), "status": "error", "error": message})
                meta["errors"].append({"mode": mode, "policy": policy, "batch": batch, "error": message})
                _write_reports(store, meta, plots=False)

            try:
                run_rounds(
                    group,
                    rounds,
                    lambda entry, index, rounds=rounds: measure(entry, index, rounds),
                    finish,
                    failed=failed,
                    collected=collected,
                )
            except KeyboardInterrupt:  # keep the rounds measured so far of the entries not finished
                for entry, datas in collected.items():
                    if 0 < len(datas) < rounds:
                        store.add(record_of(entry, datas, rounds, group_id))
                raise
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        text = _write_reports(store, meta, plots=settings.plots)
    _print_summary(store, text)
    return 1 if meta["errors"] else 0
