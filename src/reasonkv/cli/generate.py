"""``reasonkv generate``: decode prompts with an evicting KV cache."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from reasonkv.cache.allocation import Uniform, allocation_class
from reasonkv.cache.spec import CacheSpec
from reasonkv.cli.args import (
    add_cache_arguments,
    add_compile_argument,
    add_decoding_arguments,
    add_model_arguments,
    cache_spec_from,
    load_model_from,
)
from reasonkv.generation import generate
from reasonkv.generation.context import check_context
from reasonkv.generation.inputs import encode_prompts, stop_strings, vocab_size
from reasonkv.generation.sampling import Sampling
from reasonkv.policies import parse_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--prompt-file", type=Path, help="a text file, one prompt per line")
    parser.add_argument("--policy", default="streaming", help="eviction policy (see `reasonkv policies`)")
    add_cache_arguments(parser, budget=256)
    add_decoding_arguments(parser, max_new_tokens=256)
    add_compile_argument(parser)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument(
        "--no-chat", action="store_true", help="do not apply the model's chat template (reasonkv.generate: chat=False)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON record per prompt")


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return args.prompt
    path = args.prompt_file
    if path.is_dir():
        raise IsADirectoryError(f"prompt file {path} is a directory, not a file")
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"prompt file {path} is not UTF-8 text") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {args.prompt_file}")
    return prompts


def spec_from(args: argparse.Namespace) -> CacheSpec:
    """The cache the arguments describe: refused now, not after the model loads, if it cannot be built."""
    return cache_spec_from(args, args.policy, parse_options(args.policy, args.option))


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    spec = spec_from(args)
    if args.compile:
        spec.check_compile()
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    stop_strings(args.stop)
    model, tokenizer = load_model_from(args)
    # Templated and tokenized as reasonkv.generate does (chat unless --no-chat), then checked against the context.
    ids = encode_prompts(tokenizer, prompts, vocab_size(model), chat=not args.no_chat)
    check_context(model, ids, sampling.max_new_tokens)
    results = generate(
        model,
        tokenizer,
        ids,
        spec,
        **dataclasses.asdict(sampling),
        stop=args.stop,
        progress=sys.stderr.isatty(),
        compile=args.compile,
    )
    for prompt, result in zip(prompts, results, strict=True):
        if args.json:
            record = {"prompt": prompt, "text": result.text, "tokens": result.num_tokens}
            record.update(finish_reason=result.finish_reason, stats=result.stats)
            print(json.dumps(record))
            continue
        stats = result.stats
        print(f"### {prompt}\n{result.text}\n")
        print(
            f"[{stats['policy']} K={stats['budget']} B={stats['buffer']}{_tier(stats)}{_allocation(stats)}] "
            f"{result.num_tokens} tokens "
            f"({result.finish_reason}), {stats['tokens_per_second']:.1f} tok/s, "
            f"{stats['evictions']} evictions, peak {stats['peak_slots']} slots{_compiled(stats)}{_selection(stats)}\n"
        )
    return 0


def _selection(stats: dict) -> str:
    """A selection policy's reads: it holds every token and each decode step reads K per head."""
    read = stats.get("selection")
    if read is None or not read["decode_steps"]:
        return ""
    return (
        f"; selection: held every token, read {read['kv_bytes_read_per_step'] / 1e6:.2f} of "
        f"{read['kv_bytes_full_read_per_step'] / 1e6:.2f} MB of K/V per decode step ({read['read_fraction']:.0%})"
    )


def _allocation(stats: dict) -> str:
    rule = allocation_class(stats.get("allocation", Uniform.name))
    return f" allocation={rule.name}" if rule.per_head else ""


def _compiled(stats: dict) -> str:
    ran = stats.get("compile")
    if ran is None:
        return ""
    if not ran["compiled"]:
        return f"; decoded eagerly: {ran['eager_reason']}"
    return f"; compiled ({ran['backend']}): {ran['compilations']} compilation(s), {ran['warmup_seconds']:.1f} s apart"


def _tier(stats: dict) -> str:
    if not stats["quantized"]:
        return ""
    tiers = stats["peak_kv_bytes_by_tier"]
    return f" Q={stats['quantized']} int{stats['bits']}; peak K/V {tiers['full']} + {tiers['quantized']} bytes"
