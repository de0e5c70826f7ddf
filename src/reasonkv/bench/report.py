"""From records to the overhead summary and the markdown report.

The summary compares policies measured side by side in one run (ratios, never absolute claims); its sections
(a) to (f) say in the report what each compares. Every ratio sets two entries measured in the same
interleaved rounds (:func:`~reasonkv.bench.rounds.same_rounds`); an entry of other rounds gets none.
"""

from __future__ import annotations

from reasonkv.bench.compiled import COMPILED, compiled_label
from reasonkv.bench.layers import layer_markdown, layer_summary
from reasonkv.bench.markdown import cell, section, table
from reasonkv.bench.measure import PHASES
from reasonkv.bench.memory import format_bytes, held_bytes
from reasonkv.bench.reads import reads_markdown, reads_summary, window_read
from reasonkv.bench.rounds import same_rounds
from reasonkv.bench.settings import EVICTION, MAX_BATCH, TRANSFORMERS
from reasonkv.bench.targets import (
    EVICTION_TARGET_S,
    cheapest_of,
    cheapest_text,
    failures,
    mark,
    sweep_targets,
    targets_markdown,
)
from reasonkv.bench.variants import RAGGED, variant_markdown, variant_summaries
from reasonkv.bench.windows import beside, by_length, sweeps_by_batch
from reasonkv.models import bundled_model

__all__ = ["markdown", "summarise", "summary_text"]


def _nearest(windows: dict[int, dict], length: int) -> tuple[int, dict] | None:
    if not windows:
        return None
    best = min(windows, key=lambda tokens: (abs(tokens - length), tokens))
    return best, windows[best]


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def _sweep_summary(records: list[dict]) -> dict:
    config = records[0]["config"]
    budget, buffer = config["budget"], config["buffer"]
    by_policy = {r["policy"]: r for r in records}
    full, streaming = by_policy.get("full"), by_policy.get("streaming")
    plain, static = by_policy.get(TRANSFORMERS), by_policy.get(compiled_label(TRANSFORMERS))
    reference_length = budget + buffer // 2
    reference = _nearest(by_length(full) if full else {}, reference_length)
    full_step = reference[1]["step_median_s"] if reference else None
    lengths = list(config["lengths"])
    out: dict = {
        "budget": budget,
        "buffer": buffer,
        "lengths": lengths,
        "full_reference": None
        if reference is None
        else {"length": reference[0], "wanted_length": reference_length, "step_median_s": full_step},
        "policies": {},
    }
    for name, record in by_policy.items():
        windows = by_length(record)
        reached = [t for t in lengths if t in windows]
        versus = beside(record, static if name.endswith(COMPILED) else plain)  # compiled against compiled
        full_windows, streaming_windows = beside(record, full), beside(record, streaming)
        step = full_step if same_rounds(record, full or {}) else None
        per_token = record.get("kv_bytes_per_token")
        batch = record["batch"]
        summary: dict = {"evicts": record.get("evicts", name not in ("full", TRANSFORMERS))}
        summary["reads_attention"] = record.get("reads_attention")
        summary["overhead_pct"] = {t: _pct(windows[t]["eviction_overhead_s"], step) for t in reached}
        # Lengths whose window starts after the first eviction: the cache holds K to K + B slots.
        evicted = [t for t in reached if windows[t]["window_start"] >= budget + buffer]
        steady = evicted or reached[-1:]  # else the longest
        values = [summary["overhead_pct"][t] for t in steady if summary["overhead_pct"][t] is not None]
        summary["overhead_pct_steady"] = max(values) if values else None
        summary["steady_lengths"] = steady
        summary["step_vs_streaming"] = _versus(windows, streaming_windows, lengths, "step_mean_s")
        summary["tokens_per_s"] = {t: windows[t]["tokens_per_s"] for t in reached}
        summary["tokens_per_s_vs_full"] = _versus(windows, full_windows, lengths, "tokens_per_s")
        summary["tokens_per_s_vs_transformers"] = _versus(windows, versus, lengths, "tokens_per_s")
        summary["cumulative_tokens_per_s_vs_full"] = _versus(windows, full_windows, lengths, "cumulative_tokens_per_s")
        prefill_evicted = [t for t in reached if windows[t].get("prefill_evictions", 0) > 0]
        for key, phases in (
            ("prefill_eviction_s", ("score", "gather")),
            ("prefill_bookkeeping_s", ("record", "observe")),
        ):
            summary[key] = {t: sum(windows[t]["prefill_phases_s"].get(p, 0.0) for p in phases) for t in prefill_evicted}
        if summary["evicts"]:
            short = windows.get(budget)
            long_pick = _nearest({tokens: w for tokens, w in windows.items() if tokens <= 8 * budget}, 8 * budget)
            fits = short is not None and long_pick is not None and long_pick[0] > budget
            summary["flatness"] = _flatness(long_pick, budget, short) if fits else None
            # The step at K holds fewer slots than a steady cache (K to K + B) and never evicts, so the model's
            # own attention makes it cheaper whatever the policy; between two steady lengths only what grows
            # with the sequence (a policy's per-position state, say) changes the step.
            first = min((t for t in evicted if long_pick and t < long_pick[0]), default=None)
            summary["flatness_steady"] = None if first is None else _flatness(long_pick, first, windows[first])
            if per_token:
                # Full-attention layers: K + B tokens (K + 2B when rows evict apart); sliding layers: their window.
                bound = (budget + buffer * (2 if name.endswith(RAGGED) else 1)) * per_token * batch
                window_bound = (record.get("window_kv_bytes") or 0) * batch
                held = max((w["kv_bytes"] for w in windows.values()), default=0)
                summary["kv_bytes_max"] = held
                summary["kv_bytes_bound"] = bound + window_bound
                summary["kv_within_bound"] = held <= bound + window_bound
                if window_bound:
                    summary["kv_full_max"] = max(w["kv_bytes_full"] for w in windows.values())
                    summary["kv_full_bound"] = bound
                    summary["kv_sliding_max"] = max(w["kv_bytes_sliding"] for w in windows.values())
                    summary["kv_sliding_bound"] = window_bound
        out["policies"][name] = summary
    out["reads"] = reads_summary(records)
    layers = layer_summary(records)
    if layers:  # a run under an allocation: K/V bytes per layer
        per_token = next((r["kv_bytes_per_token"] for r in records if r.get("kv_bytes_per_token")), None)
        count = len(next(iter(layers.values()))["held"])
        uniform = (budget + buffer) * per_token * records[0]["batch"] // count if per_token else None
        out["layers"] = {"allocation": config.get("allocation"), "entries": layers, "uniform_layer_bytes": uniform}
    out["targets"] = sweep_targets(out)
    return out


def _versus(windows: dict, other: dict, lengths: list[int], key: str) -> dict:
    """``key`` of ``windows`` over ``other``'s, at each of ``lengths`` both reached (and ``windows`` has it)."""
    both = [t for t in lengths if t in windows and t in other and windows[t].get(key) is not None]
    return {t: _ratio(windows[t][key], other[t].get(key)) for t in both}


def _flatness(long_pick: tuple[int, dict], short_length: int, short: dict) -> dict:
    """The step time at the long length over the step at the short one."""
    ratio = _ratio(long_pick[1]["step_mean_s"], short["step_mean_s"])
    return {"ratio": ratio, "long_length": long_pick[0], "short_length": short_length}


def _pct(part, whole):
    return None if part is None or whole in (None, 0) else 100.0 * part / whole


def summarise(records: list[dict]) -> dict:
    """Overhead summary, eviction-cost and max-batch comparisons of every finished record."""
    out: dict = {"sweep": {}, "eviction_cost": None, "max_batch": None, **variant_summaries(records)}
    for batch, group in sweeps_by_batch(records).items():
        out["sweep"][str(batch)] = _sweep_summary(group)

    evictions = [r for r in records if r.get("mode") == "eviction-cost"]
    if evictions:
        costs = {r["policy"]: r["mean_s"] for r in evictions}
        out["eviction_cost"] = {"mean_s": costs, **cheapest_of(costs)}

    batches = [r for r in records if r.get("mode") == "max-batch"]
    if batches:
        full = next((r for r in batches if r["policy"] == "full"), {})
        out["max_batch"] = {
            f"{key}_vs_full": {r["policy"]: _ratio(r.get(key), full.get(key)) for r in batches}
            for key in ("tokens_per_s", "max_batch")
        }
    return out


# --------------------------------------------------------------------------- markdown


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.2f}"


def _policy_order(names) -> list[str]:
    names = list(dict.fromkeys(names))
    first = [n for n in ("full", TRANSFORMERS, "streaming") if n in names]
    return first + [n for n in names if n not in first]


def _sweep_markdown(records: list[dict], summary: dict, meta: dict) -> list[str]:
    config = records[0]["config"]
    budget, buffer = config["budget"], config["buffer"]
    if config.get("prefill_to_length"):
        n = config["decode_steps"]
        chunk = config.get("prefill_chunk") or 0
        how = (
            f"each length L reached by a prefill of L - {n} - 2 tokens (a {config['prompt_length']}-token prompt, "
            "then the rest as if generated"
            + (f", at most {chunk} tokens per forward)" if chunk else " in one forward)")
            + f", 2 untimed decode steps, then {n} timed decode steps ending at L; an evicting policy is "
            "evicted to K by the prefill, so it is measured in its steady state; one cache per entry, extended "
            "from each length to the next by a prefill of the tokens in between where they leave room"
        )
    else:
        how = f"decoded from a {config['prompt_length']}-token prompt up to {max(config['lengths'])} tokens"
    rounds = config.get("rounds", 1)
    how += f"; window {config['window']} steps"
    if rounds > 1:
        how += (
            f"; the entries of a batch size measured in {rounds} interleaved rounds (A B C A B C ...), each row the "
            "median round, *rounds* the smallest and largest of the rounds' mean step times, *SM MHz* the GPU's "
            "clock at the end of the median round's window"
        )
    shared = ""
    if config.get("allocation"):  # every evicting entry under it; the full cache has no budget to share
        heads = "ragged" if config.get("ragged_heads", True) else "padded"
        shared = f", allocation {config['allocation']}, {heads} heads"
        how += f"; every evicting entry runs under the {config['allocation']} allocation ({heads} heads)"
    lines = [f"## Length sweep (K = {budget}, B = {buffer}{shared})", "", f"{how}.", ""]
    peak_kind = "CUDA max allocated" if meta.get("device", "cpu").startswith("cuda") else "process peak RSS"
    for batch, sweeps in sweeps_by_batch(records).items():
        group = {r["policy"]: r for r in sweeps}
        batch_summary = summary["sweep"].get(str(batch), {})
        lines += [f"### Batch {batch}", ""]
        rows = []
        hybrid = any(w.get("kv_bytes_sliding") for r in group.values() for w in r["windows"])
        selecting = any(r.get("selects") for r in group.values())  # then a column of the bytes a step read
        for name in _policy_order(group):
            windows = by_length(group[name])
            for tokens in (t for t in config["lengths"] if t in windows):
                w = windows[tokens]
                rows.append(
                    [
                        name,
                        str(tokens),
                        f"{w['tokens_per_s']:.1f}",
                        *(_ms(w[key]) for key in ("step_median_s", "step_mean_s")),
                        _rounds_cell(w),
                        cell(w.get("gpu_clock_mhz"), "{}"),
                        *(_ms(w["split_s"][p]) for p in ("forward", *PHASES)),
                        *(str(w[key]) for key in ("evictions", "slots")),
                        format_bytes(held_bytes(w)),
                        *([format_bytes(window_read(w, bool(group[name].get("selects"))))] if selecting else []),
                        format_bytes(w["kv_bytes"]),
                        *(format_bytes(w[key]) for key in ("kv_bytes_full", "kv_bytes_sliding") if hybrid),
                        format_bytes(w.get("peak_memory_bytes")),
                    ]
                )
        header = ["policy", "length", "tok/s", "step ms (median)", "step ms (mean)", "rounds", "SM MHz", "forward"]
        header += [*PHASES, "evictions", "slots", "KV held"]
        header += ["KV read per step", "KV allocated"] if selecting else ["KV allocated"]
        header += ["KV full-attention layers", "KV sliding layers"] if hybrid else []
        header += [f"peak ({peak_kind})"]
        lines += table(header, rows)
        lines += _summary_markdown(batch, batch_summary)
    return lines


def _rounds_cell(window: dict) -> str:
    """``min-max (n)`` of the rounds' mean step times in ms (``-`` for a window from one round)."""
    spread = window.get("step_mean_spread_s")
    if spread is None or window["rounds"]["count"] < 2:
        return "-"
    return f"{_ms(spread['min'])}-{_ms(spread['max'])} ({window['rounds']['count']})"


_BY_KIND = ("kv_full_max", "kv_full_bound", "kv_sliding_max", "kv_sliding_bound")


def _summary_markdown(batch: int, summary: dict) -> list[str]:
    if not summary:
        return []
    lengths = summary["lengths"]
    policies = summary["policies"]
    order = _policy_order(policies)
    ref = summary.get("full_reference")
    ref_text = (
        "no full-cache run to compare with"
        if ref is None
        else f"full-cache step at {ref['length']} tokens = {_ms(ref['step_median_s'])} ms"
    )
    lines = [f"#### Overhead summary (batch {batch})", ""]
    lines += [
        "(a) Eviction overhead: record + observe + score + gather per decode step, as % of a full-cache step "
        f"at K + B/2 ({ref_text}). *steady* = the largest value over lengths whose window starts after the "
        "first eviction.",
        "",
    ]
    rows = [
        [n, *(cell(policies[n]["overhead_pct"].get(tokens), "{:.2f}") for tokens in lengths)]
        + [cell(policies[n]["overhead_pct_steady"], "{:.2f}")]
        for n in order
    ]
    lines += table(["policy", *(f"@{tokens}" for tokens in lengths), "steady"], rows)
    if "streaming" in policies:
        lines += ["(b) Step time relative to streaming (same eviction schedule, trivial scoring):", ""]
        lines += _length_table(order, lengths, _ratio_text(policies, "step_vs_streaming"))
    lines += [
        "(c) Flatness: step time at 8 K over step time at K (a window that ends at K: the cache holds fewer "
        "slots than K + B and never evicts), and over the first length measured in its steady state (both "
        "windows hold K to K + B slots and one eviction); the KV bytes allocated against (K + B) x layers x 2 x "
        "kv_heads x head_dim x dtype size x batch (full-attention layers; sliding-window layers add their window, "
        "(window - 1) tokens each):",
        "",
    ]
    hybrid = any("kv_sliding_max" in policies[n] for n in order)
    evicting = {n: policies[n] for n in order if policies[n]["evicts"]}
    rows = [
        [
            n,
            *(
                "-" if not flat else f"{cell(flat['ratio'], '{:.3f}')} ({flat['long_length']}/{flat['short_length']})"
                for flat in (s.get("flatness"), s.get("flatness_steady"))
            ),
            *(format_bytes(s.get(key)) for key in ("kv_bytes_max", "kv_bytes_bound")),
            mark(s.get("kv_within_bound")),
            *([format_bytes(s.get(key)) for key in _BY_KIND] if hybrid else []),
        ]
        for n, s in evicting.items()
    ]
    header = ["policy", "flatness vs K", "flatness vs steady", "KV allocated (max)", "bound", "within"]
    if hybrid:
        header += ["full-attention layers (max)", "bound: K + B tokens", "sliding layers (max)", "bound: window"]
    lines += table(header, rows)
    lines += reads_markdown(summary.get("reads", {}), order)
    if summary.get("layers"):
        layers = summary["layers"]
        lines += layer_markdown(layers["entries"], order, uniform_layer_bytes=layers["uniform_layer_bytes"])
    if "full" in policies:
        lines += ["(d) Tokens/s relative to full (window at L; in brackets: from the first decode step to L):", ""]

        def versus_full(n: str, tokens: int) -> str:
            cumulative = policies[n]["cumulative_tokens_per_s_vs_full"].get(tokens)
            text = cell(policies[n]["tokens_per_s_vs_full"].get(tokens), "{:.2f}")
            return text if cumulative is None else f"{text} ({cumulative:.2f})"

        lines += _length_table(order, lengths, versus_full)
    if TRANSFORMERS in policies:
        lines += [
            "(e) Tokens/s relative to transformers' own cache (the one `model.generate` builds, no reasonkv hook; "
            "same loop, prompts and lengths; a compiled entry relative to transformers~compiled):",
            "",
        ]
        lines += _length_table(order, lengths, _ratio_text(policies, "tokens_per_s_vs_transformers"))
    evicted = [n for n in order if policies[n].get("prefill_eviction_s")]
    if evicted:
        lines += [
            "(f) The prefill's evictions: the tokens prefilled to reach L - n - 2 (from nothing, or from the "
            "previous length when the cache was extended) evicted to K (after each forward once due; "
            "score + select + gather, ms), and the policy's bookkeeping in the prefill (record + observe, ms):",
            "",
        ]
        columns = {"evict": "prefill_eviction_s", "bookkeeping": "prefill_bookkeeping_s"}
        rows = [[n, *(_ms(policies[n][key].get(t)) for key in columns.values() for t in lengths)] for n in evicted]
        lines += table(["policy", *(f"{word} @{t}" for word in columns for t in lengths)], rows)
    lines += targets_markdown(summary["targets"])
    return lines


def _length_table(order: list[str], lengths: list[int], text) -> list[str]:
    """A table of ``text(policy, length)`` for each policy at every length."""
    rows = [[n, *(text(n, tokens) for tokens in lengths)] for n in order]
    return table(["policy", *(f"@{tokens}" for tokens in lengths)], rows)


def _ratio_text(policies: dict, key: str):
    """The cell of each policy's ratio ``key`` at a length."""
    return lambda n, tokens: cell(policies[n][key].get(tokens), "{:.3f}")


def _eviction_markdown(records: list[dict], summary: dict | None) -> list[str]:
    config = records[0]["config"]
    lines = section(
        f"Eviction cost ({config['cached']} cached tokens, K = {config['cached'] - config['buffer']}, "
        f"B = {config['buffer']})",
        "One eviction (score + select + gather), mean over repeats after a warm-up eviction.",
    )
    times = ("mean_s", "median_s", "std_s", "min_s", "score_mean_s", "gather_mean_s")
    rows = [
        [r["policy"], str(r["batch"]), *(_ms(r[key]) for key in times), str(r["repeats"])]
        for r in sorted(records, key=lambda r: r["mean_s"])
    ]
    lines += table(["policy", "batch", "mean ms", "median ms", "std ms", "min ms", "score ms", "gather ms", "n"], rows)
    if summary and summary.get("cheapest_nontrivial"):
        lines += [cheapest_text(summary["cheapest_nontrivial"], summary.get("epikv_cheapest")) + ".", ""]
    if summary:
        bounded = {n: s <= EVICTION_TARGET_S for n, s in summary["mean_s"].items()}
        lines += [f"One eviction within {EVICTION_TARGET_S:g} s (mean): {failures(bounded)}.", ""]
    return lines


def _max_batch_markdown(records: list[dict], summary: dict | None) -> list[str]:
    config = records[0]["config"]
    lines = section(
        f"Max batch (memory limit {format_bytes(config['memory_limit_bytes'])}, length {config['length']}, "
        f"K = {config['budget']}, B = {config['buffer']})",
        "KV per row is computed (exact formula); the other per-row bytes and the fixed part are measured "
        f"from two probe batches {tuple(config['probe_batches'])}; tokens/s is measured at the batch shown.",
    )
    ratios = (summary or {}).get("tokens_per_s_vs_full", {})
    by_policy = {r["policy"]: r for r in records}
    rows = [
        [
            record["policy"],
            *(format_bytes(record["memory_model"][key]) for key in ("kv_row", "other_row", "fixed")),
            *(str(record[key]) for key in ("max_batch", "measured_batch")),
            cell(record.get("tokens_per_s"), "{:.1f}"),
            cell(ratios.get(record["policy"]), "{:.2f}"),
            "; ".join(record.get("notes", [])) or "-",
        ]
        for record in (by_policy[name] for name in _policy_order(by_policy))
    ]
    header = ["policy", "KV/row (computed)", "other/row (measured)", "fixed (measured)", "fits", "measured at"]
    lines += table(header + ["tok/s", "vs full", "notes"], rows)
    return lines


def _cost_markdown(records: list[dict], summary: dict) -> list[str]:
    """The eviction-cost and max-batch sections, of the modes that ran."""
    lines = []
    for mode, key, section_of in (
        (EVICTION, "eviction_cost", _eviction_markdown),
        (MAX_BATCH, "max_batch", _max_batch_markdown),
    ):
        chosen = [r for r in records if r.get("mode") == mode]
        lines += section_of(chosen, summary.get(key)) if chosen else []
    return lines


def markdown(records: list[dict], summary: dict, meta: dict) -> str:
    """The whole report as markdown."""
    machine = meta.get("machine", {})
    hardware = machine.get("gpu") or machine.get("cpu") or "?"
    bundled = bundled_model(str(meta.get("model")))
    source = f", the bundled {bundled.gguf} dequantized on load" if bundled else ""
    lines = [
        "# reasonkv bench",
        "",
        f"- command: `{meta.get('command', '')}`",
        f"- date: {meta.get('date', '')}",
        f"- model: {meta.get('model')}{source} ({meta.get('dtype')}, {meta.get('device')}, {meta.get('attn')}); "
        f"weights {format_bytes(meta.get('weight_bytes'))}; KV {meta.get('kv_bytes_per_token')} bytes per token "
        "per row",
        f"- machine: {hardware} ({machine.get('cpu_count')} CPUs, {machine.get('torch_threads')} torch threads); "
        f"torch {machine.get('torch')}, transformers {machine.get('transformers')}",
        "",
    ]
    sweeps = [r for r in records if r.get("mode") == "sweep"]
    if sweeps:
        lines += _sweep_markdown(sweeps, summary, meta)
        lines += variant_markdown(summary)
    lines += _cost_markdown(records, summary)
    errors = meta.get("errors") or []
    if errors:
        lines += ["## Entries that failed", ""]
        lines += [f"- {e['mode']} {e['policy']} batch {e.get('batch')}: {e['error']}" for e in errors]
        lines.append("")
    return "\n".join(lines)


def summary_text(records: list[dict], summary: dict, meta: dict) -> str:
    """What the command prints at the end: the summaries without the per-length tables."""
    lines: list[str] = []
    for batch, batch_summary in summary["sweep"].items():
        lines += _summary_markdown(int(batch), batch_summary)
    lines += variant_markdown(summary)
    lines += _cost_markdown(records, summary)
    return "\n".join(lines)
