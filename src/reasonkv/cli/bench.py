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

Outputs in ``--out``: ``results.jsonl`` (one record per finished entry, appended as measured),
``bench.json`` (everything, with the command line, date, machine and versions), ``bench.md`` and
PNG plots. Rerunning with the same ``--out`` skips finished entries unless ``--force``. The folder
must be the bench's own (or new); it is locked while the bench runs (:func:`reasonkv.bench.store.claim_output`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import shlex
import signal
import sys
import time
from pathlib import Path

from reasonkv.bench.plan import DEFAULT_LENGTHS, EVICTION, SWEEP, TRANSFORMERS, Plan, build_plan
from reasonkv.bench.store import ResultStore, claim_output, entry_key, now_iso
from reasonkv.cli.args import add_buffer_argument, add_policy_options, quantized_argument
from reasonkv.models import DEFAULT_MODEL
from reasonkv.runs.outputs import write_atomic
from reasonkv.runs.store import json_safe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="smollm2-135m or gemma3-270m (bundled), shape:<name> (random weights: tiny, smollm2-135m-shape, "
        "llama-3.1-8b, r1-distill-llama-8b, qwen3-4b, qwen3-14b, gpt-oss-20b (needs --attn eager), gemma-3-27b), "
        "a local directory, a .gguf file or a hub id (default smollm2-135m)",
    )
    model.add_argument("--dtype", default="bf16", help="fp32 | bf16 (default) | fp16")
    model.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:N")
    model.add_argument("--attn", default="sdpa", help="sdpa (default) | flash_attention_2 | eager")
    model.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's own choice; recorded either way)",
    )

    policy = parser.add_argument_group("policies")
    policy.add_argument(
        "--policies",
        default="all",
        help="comma-separated policy names, or 'all' (default: every registered policy); full and streaming "
        "always run as references",
    )
    add_policy_options(policy)
    policy.add_argument(
        "--budget", type=int, default=512, help="K: tokens kept per head after an eviction (default 512)"
    )
    add_buffer_argument(policy)
    policy.add_argument("--seed", type=int, default=0, help="seeds the prompts and the policies (default 0)")
    policy.add_argument(
        "--quantized",
        type=quantized_argument,
        default=0,
        metavar="Q",
        help="also measure every requested evicting policy with Q tokens per head kept quantized, its "
        "full-precision budget lowered so that its nominal K/V bytes equal the plain policy's at --budget "
        "(length sweep; default 0: no such variants)",
    )
    policy.add_argument(
        "--bits", type=int, choices=(4, 8), default=None, help="code width of the quantized tier (default 8)"
    )

    sweep = parser.add_argument_group("length sweep")
    sweep.add_argument(
        "--lengths",
        default=None,
        help=f"lengths to report, strictly increasing (default {','.join(map(str, DEFAULT_LENGTHS))}; "
        "the sweep runs when this is given or when neither --max-batch nor --eviction-cost is)",
    )
    sweep.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes (default 1)")
    sweep.add_argument(
        "--prompt-length",
        type=int,
        default=32,
        help="tokens of the fixed random prompt; prefills feed the rest as if generated (default 32)",
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
        default=256,
        help="n: decode steps timed with --prefill-to-length and --max-batch (default 256)",
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
        default=0,
        help="most tokens per prefill forward, summed over the batch (default 0: one forward; an evicting "
        "policy evicts after each chunk once due)",
    )

    evict = parser.add_argument_group("eviction cost")
    evict.add_argument(
        "--eviction-cost", action="store_true", help="time one eviction per policy (batch 1, K = --cached - --buffer)"
    )
    evict.add_argument("--cached", type=int, default=None, help="N: tokens cached at each eviction (K = N - B)")
    evict.add_argument(
        "--repeats", type=int, default=5, help="evictions timed per policy, after one warm-up (default 5)"
    )

    batch = parser.add_argument_group("max batch")
    batch.add_argument("--max-batch", action="store_true", help="largest batch per policy within --memory-limit")
    batch.add_argument("--memory-limit", default=None, help="e.g. 24GiB, 48GB, 512MiB")
    batch.add_argument("--length", type=int, default=None, help="L: sequence length the batch must fit")
    batch.add_argument(
        "--probe-batches", default="1,2", help="two batch sizes the memory overhead is measured at (default 1,2)"
    )
    batch.add_argument("--probe-steps", type=int, default=4, help="decode steps of each probe (default 4)")
    batch.add_argument(
        "--max-measured-batch", type=int, default=256, help="largest batch whose throughput is measured (default 256)"
    )

    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, required=True, help="folder for results.jsonl, bench.json/md, PNGs")
    output.add_argument("--force", action="store_true", help="re-measure entries already in --out")
    output.add_argument("--no-progress", action="store_true", help="no progress bars")
    output.add_argument("--no-plots", action="store_true", help="no PNG plots (JSON and markdown only)")


def canonical_command(args: argparse.Namespace) -> str:
    """The command line with every setting spelled out (what reproduces the run)."""
    words = ["reasonkv", "bench", "--model", args.model, "--dtype", args.dtype, "--device", args.device]
    words += ["--attn", args.attn, "--policies", args.policies, "--budget", str(args.budget)]
    if args.threads is not None:
        words += ["--threads", str(args.threads)]
    words += ["--buffer", str(args.buffer), "--seed", str(args.seed), "--batch-sizes", args.batch_sizes]
    if args.quantized:
        words += ["--quantized", str(args.quantized), "--bits", str(args.bits or 8)]
    for option in args.option:
        words += ["-o", option]
    if args.lengths is not None:
        words += ["--lengths", args.lengths]
    words += ["--prompt-length", str(args.prompt_length)]
    if args.window is not None:
        words += ["--window", str(args.window)]
    if args.prefill_to_length:
        words.append("--prefill-to-length")
    if args.transformers_cache:
        words.append("--transformers-cache")
    words += ["--decode-steps", str(args.decode_steps), "--prefill-chunk", str(args.prefill_chunk)]
    if args.no_sync_timing:
        words.append("--no-sync-timing")
    if args.eviction_cost:
        words += ["--eviction-cost", "--cached", str(args.cached), "--repeats", str(args.repeats)]
    if args.max_batch:
        words += ["--max-batch", "--memory-limit", str(args.memory_limit), "--length", str(args.length)]
        words += ["--probe-batches", args.probe_batches, "--probe-steps", str(args.probe_steps)]
        words += ["--max-measured-batch", str(args.max_measured_batch)]
    words += ["--out", str(args.out)]
    if args.force:
        words.append("--force")
    return shlex.join(words)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _load(plan: Plan):
    from reasonkv.models import load_model

    _say(f"loading {plan.model} ({plan.dtype}, {plan.device}, {plan.attn}) ...")
    try:
        model, _ = load_model(plan.model, dtype=plan.dtype, device=plan.device, attn_implementation=plan.attn)
    except (OSError, ImportError) as error:
        raise ValueError(f"cannot load model {plan.model!r}: {error}") from None
    return model


def _measure(model, plan: Plan, mode: str, policy: str, batch: int | None, progress: bool) -> dict:
    from reasonkv.bench.eviction import measure_eviction_cost
    from reasonkv.bench.maxbatch import measure_max_batch
    from reasonkv.bench.measure import measure_prefilled_sweep, measure_sweep
    from reasonkv.bench.tiers import tiered_budget

    config = plan.configs[mode]
    options = plan.options[policy]
    budget = config.get("budget")
    variant = plan.tiers.get(policy)
    if variant is not None:  # a tiered variant: the policy with a quantized tier, at the plain K/V bytes
        tier = tiered_budget(model, budget, variant["quantized"], variant["bits"])
        policy, budget = variant["policy"], tier["budget"]
        # The measuring functions hand their options on to generate / EvictingCache as keywords.
        options = {**options, "quantized": tier["quantized"], "bits": tier["bits"]}
    if mode == SWEEP:
        common = dict(policy=policy, options=options, budget=budget, buffer=config["buffer"], batch=batch)
        common.update(lengths=plan.sweep_lengths(policy), seed=config["seed"], progress=progress)
        common.update(sync_timing=config["sync_timing"])
        if config["prefill_to_length"]:
            data = measure_prefilled_sweep(
                model,
                decode_steps=config["decode_steps"],
                window=config["window"],
                prefill_chunk=config["prefill_chunk"],
                prompt_length=config["prompt_length"],
                **common,
            )
        else:
            data = measure_sweep(model, prompt_length=config["prompt_length"], window=config["window"], **common)
        if variant is not None:
            data["tier"] = {"policy": policy, **tier}
        return data
    if mode == EVICTION:
        return measure_eviction_cost(
            model,
            policy=policy,
            options=options,
            cached=config["cached"],
            buffer=config["buffer"],
            repeats=config["repeats"],
            batch=batch,
            prefill_chunk=config["prefill_chunk"],
            prompt_length=config["prompt_length"],
            seed=config["seed"],
        )
    return measure_max_batch(
        model,
        policy=policy,
        options=options,
        budget=config["budget"],
        buffer=config["buffer"],
        length=config["length"],
        memory_limit=config["memory_limit_bytes"],
        decode_steps=config["decode_steps"],
        probe_batches=tuple(config["probe_batches"]),
        probe_steps=config["probe_steps"],
        max_measured_batch=config["max_measured_batch"],
        prefill_chunk=config["prefill_chunk"],
        prompt_length=config["prompt_length"],
        seed=config["seed"],
    )


def _reads_attention(model, plan: Plan) -> dict[str, bool]:
    """Whether each entry's policy reads attention (records queries through the attention tap)."""
    from reasonkv.hf import model_info
    from reasonkv.policies import get_policy

    info = model_info(model)
    reads = {}
    for name in plan.policies:
        policy = plan.tiers.get(name, {}).get("policy", name)
        reads[name] = policy != TRANSFORMERS and get_policy(policy, **plan.options[name]).needs(info).taps_attention
    return reads


def _headline(mode: str, data: dict) -> str:
    if mode == SWEEP:
        last = max(data["windows"], key=lambda w: w["length"])
        return f"{last['tokens_per_s']:.1f} tok/s, {1000 * last['step_mean_s']:.2f} ms/step at {last['length']}"
    if mode == EVICTION:
        return f"{1000 * data['mean_s']:.3f} ms per eviction"
    tps = data.get("tokens_per_s")
    return f"fits {data['max_batch']} rows; {'-' if tps is None else f'{tps:.1f}'} tok/s at {data['measured_batch']}"


def _write_reports(store, meta: dict, *, plots: bool) -> None:
    import json

    from reasonkv.bench.report import markdown, summarise

    records = store.ok()
    summary = summarise(records)
    document = json_safe({**meta, "records": records, "summary": summary})
    write_atomic(store.out / "bench.json", json.dumps(document, indent=1, allow_nan=False) + "\n")
    write_atomic(store.out / "bench.md", markdown(records, summary, meta))
    if plots and records:
        try:
            from reasonkv.bench.plots import write_plots
        except ImportError:
            _say("matplotlib is not installed: no plots (pip install matplotlib)")
            return
        write_plots(records, store.out, device=meta.get("device", "cpu"))


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)  # bad arguments fail before the folder is touched
    with claim_output(args.out):
        return _run(args, plan)


def _run(args: argparse.Namespace, plan: Plan) -> int:
    import torch

    from reasonkv.bench.machine import machine_info
    from reasonkv.bench.measure import model_dtype, warm_up
    from reasonkv.bench.memory import kv_bytes_per_token, weight_bytes

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    for warning in plan.warnings:
        _say(f"warning: {warning}")
    store = ResultStore(args.out)
    entries = plan.entries()
    for mode in plan.modes:
        rerun = [entry_key(m, p, b, plan.options[p]) for m, p, b in entries if m == mode]
        dropped = store.check_config(mode, plan.configs[mode], force=args.force, rerun=rerun)
        if dropped:
            _say(f"--force: dropped {dropped} earlier {mode} record(s)")
    pending = [e for e in entries if not store.done(e[0], e[1], e[2], plan.options[e[1]])]
    if len(pending) < len(entries):
        _say(f"{len(entries) - len(pending)} of {len(entries)} entries already in {args.out}: skipped")
    progress = not args.no_progress and sys.stderr.isatty()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    previous = store.ok()
    meta = {
        "format": 1,
        "command": canonical_command(args),
        "argv": list(sys.argv),
        "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "run"},
        "date": now_iso(),
        "model": plan.model,
        "dtype": plan.dtype,
        "device": plan.device,
        "attn": plan.attn,
        "machine": machine_info(device),
        "weight_bytes": previous[-1].get("weight_bytes") if previous else None,
        "kv_bytes_per_token": previous[-1].get("kv_bytes_per_token") if previous else None,
        "configs": plan.configs,
        "errors": [],
    }
    plots = not args.no_plots
    if not pending:
        _write_reports(store, meta, plots=plots)
        _print_summary(store, meta)
        return 0

    model = _load(plan)
    reads = _reads_attention(model, plan)
    meta["weight_bytes"] = weight_bytes(model)
    meta["kv_bytes_per_token"] = kv_bytes_per_token(model, model_dtype(model))
    warm_up(model)
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
                data = _measure(model, plan, mode, policy, batch, progress)
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
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            _write_reports(store, meta, plots=False)
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        _write_reports(store, meta, plots=plots)
    _print_summary(store, meta)
    return 1 if meta["errors"] else 0


def _print_summary(store, meta: dict) -> None:
    from reasonkv.bench.report import summarise, summary_text

    records = store.ok()
    text = summary_text(records, summarise(records), meta)
    if text.strip():
        print(text)
    print(f"results in {store.out}/ (bench.md, bench.json, results.jsonl, *.png)")
    sys.stdout.flush()
