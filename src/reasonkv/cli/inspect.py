"""``reasonkv inspect``: decode one prompt with ``full`` and some policies, and write one page of every eviction."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from reasonkv.cache.spec import CacheSpec
from reasonkv.cli.args import (
    add_cache_arguments,
    add_decoding_arguments,
    add_model_arguments,
    cache_spec_from,
    load_model_from,
)
from reasonkv.cli.outputs import check_output_file
from reasonkv.eval.datasets import load_dataset
from reasonkv.eval.prompts import build_prompt
from reasonkv.generation.context import check_context
from reasonkv.generation.inputs import encode_prompt, encode_prompts, vocab_size
from reasonkv.generation.sampling import Sampling
from reasonkv.inspect.figure import parse_steps, write_figure
from reasonkv.inspect.page import check_page_path, write_page
from reasonkv.inspect.runs import Inspection, check_compared, inspect_prompt
from reasonkv.policies import options_by_policy

DEFAULT_POLICIES = "epikv,h2o,vase-attnv"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt (chat-formatted like `generate`, unless --no-chat)")
    source.add_argument("--dataset", help="a bundled dataset name or a .jsonl file (with --problem)")
    source.add_argument("--trace", type=Path, help="a trace file written by --save-trace: no decoding")
    parser.add_argument("--problem", help="the problem's id in --dataset")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    add_cache_arguments(parser, budget=128, allocation="; the page then shows each head's budget")
    add_decoding_arguments(parser, max_new_tokens=512)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the model's chat template")
    parser.add_argument("--out", type=Path, required=True, help="the page to write (*.html)")
    parser.add_argument("--save-trace", type=Path, help="also write the runs and their traces (*.npz)")
    parser.add_argument("--png", type=Path, help="also write a static figure (*.png): layers x positions retained")
    parser.add_argument("--png-steps", default="", help="evictions in the figure, e.g. 1,4,-1 (default: three)")


def specs_from(args: argparse.Namespace) -> list[CacheSpec]:
    """The evicting caches to compare with full, refused before the model loads if they cannot be built."""
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    if not policies:
        raise ValueError(f"--policies names no policy: {args.policies!r}")
    options = options_by_policy(policies, args.option)
    specs = [cache_spec_from(args, name, options[name]) for name in policies]
    check_compared(specs)
    return specs


def run(args: argparse.Namespace) -> int:
    for path, suffix in ((args.out, ".html"), (args.save_trace, ".npz"), (args.png, ".png")):
        if path is not None and path.suffix.lower() != suffix:
            raise ValueError(f"{path}: expected a {suffix} file name")
    steps = parse_steps(args.png_steps)
    check_page_path(check_output_file(args.out, "--out"))  # before decoding: not an [Errno 2] minutes later
    for path, flag in ((args.save_trace, "--save-trace"), (args.png, "--png")):
        if path is not None:
            check_output_file(path, flag)
    if args.trace is not None:
        inspection = Inspection.load(args.trace)
    else:
        inspection = _decode(args)
        if args.save_trace is not None:
            inspection.save(args.save_trace)
            print(f"wrote {args.save_trace}", file=sys.stderr)
    write_page(args.out, inspection)
    print(f"wrote {args.out}", file=sys.stderr)
    if args.png is not None:
        write_figure(args.png, inspection, steps)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def _decode(args: argparse.Namespace) -> Inspection:
    if (args.dataset is None) != (args.problem is None):
        raise ValueError("--dataset and --problem go together: name the problem's id in the dataset")
    problem = None
    if args.dataset is not None:
        problems = {p.id: p for p in load_dataset(args.dataset)}
        if args.problem not in problems:
            shown = ", ".join(list(problems)[:5])
            raise ValueError(f"no problem {args.problem!r} in {args.dataset} (ids such as {shown})")
        problem = problems[args.problem]
    specs = specs_from(args)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    model, tokenizer = load_model_from(args)
    if problem is not None:  # eval's prompt, templated by build_prompt
        ids = [encode_prompt(tokenizer, build_prompt(tokenizer, problem))]
    else:
        ids = encode_prompts(tokenizer, [args.prompt], vocab_size(model), chat=not args.no_chat)
    check_context(model, ids, sampling.max_new_tokens)
    return inspect_prompt(
        model,
        tokenizer,
        ids[0],
        specs,
        model_name=args.model,
        **dataclasses.asdict(sampling),
        progress=True,
    )
