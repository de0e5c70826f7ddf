"""Command-line arguments shared by every command that loads a model or takes policy options."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys

from reasonkv.cache.allocation import RULES, Uniform
from reasonkv.cache.spec import ALLOCATIONS, DEFAULT_BUFFER, CacheSpec
from reasonkv.models import DEFAULT_MODEL, list_shapes, load_model
from reasonkv.sandbox.limits import check_memory, check_timeout


def add_model_arguments(
    parser: argparse.ArgumentParser, *, dtype: str = "fp32", why: str = "exact on any device", shapes: bool = False
):
    """``--model``, ``--dtype`` (default ``dtype``, for the reason ``why``), ``--device`` and ``--attn`` in a group
    "model" (or the group given). ``shapes``: the command takes token ids, so random-weight shapes too."""
    group = parser if isinstance(parser, argparse._ArgumentGroup) else parser.add_argument_group("model")
    what = f"hub id, local directory, .gguf file, {DEFAULT_MODEL} (default) or gemma3-270m (bundled)"
    if shapes:
        what += f", or shape:<name> for random weights ({', '.join(list_shapes())}; gpt-oss-20b needs --attn eager)"
    group.add_argument("--model", default=DEFAULT_MODEL, help=what)
    group.add_argument("--dtype", default=dtype, help=f"fp32 | bf16 | fp16 (default {dtype}: {why})")
    group.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    group.add_argument("--attn", default="sdpa", help="sdpa (default) | flash_attention_2 | eager")


def add_policy_options(parser) -> None:
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy hyper-parameter, e.g. -o sinks=8 -o window=32, or POLICY.KEY=VALUE for one policy "
        "(repeatable; see `reasonkv policies`)",
    )


def add_tier_arguments(parser, *, what: str = "") -> None:
    parser.add_argument(
        "--quantized",
        type=non_negative_argument,
        default=0,
        metavar="Q",
        help="Q: tokens per head kept quantized beside the K at full precision, ranked by the policy "
        f"(default 0: no quantized tier){what}",
    )
    parser.add_argument(
        "--bits", type=int, choices=(4, 8), default=None, help="code width of the quantized tier (default 8)"
    )


def add_allocation_arguments(parser, *, what: str = "") -> None:
    """How the budget is shared among layers and kv-heads (:mod:`reasonkv.cache.allocation`)."""
    parser.add_argument(
        "--allocation",
        choices=ALLOCATIONS,
        default=Uniform.name,
        help="how K x layers x kv-heads is shared: "
        + ", ".join(f"{name} ({rule.summary})" for name, rule in RULES.items())
        + what,
    )
    parser.add_argument(
        "--budgets-file", default=None, help="--allocation calibrated: the file `reasonkv calibrate --budgets` wrote"
    )
    parser.add_argument(
        "--adaptive-alpha",
        type=float,
        default=None,
        help="--allocation adaptive: every head keeps at least ceil(alpha x K) (default 0.2; 1 = uniform)",
    )
    parser.add_argument(
        "--padded-heads",
        action="store_true",
        help="under an allocation, pad every head to the widest in dense buffers instead of ragged storage",
    )


def add_cache_arguments(parser, *, budget: int, allocation: str = "") -> None:
    """The evicting cache's flags: ``--budget`` (default ``budget``), ``--buffer``, the quantized tier, the
    allocation (its help followed by ``allocation``) and ``-o``, read back by :func:`cache_spec_from`."""
    parser.add_argument(
        "--budget", type=budget_argument, default=budget, help=f"K: tokens kept per head (default {budget})"
    )
    add_buffer_argument(parser)
    add_tier_arguments(parser)
    add_allocation_arguments(parser, what=allocation)
    add_policy_options(parser)


def cache_spec_from(args: argparse.Namespace, policy: str, options: dict) -> CacheSpec:
    """``policy``'s cache under the command's flags (:func:`add_cache_arguments`, ``--seed``: each named as the
    spec's field), with its parsed ``options``."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(CacheSpec) if hasattr(args, f.name)}
    # --padded-heads: ragged=False; without it None (not given: refused only when given, off its mode)
    given.update(policy=policy, ragged=False if getattr(args, "padded_heads", False) else None)
    return CacheSpec.build(**given, **options)


def add_decoding_arguments(parser, *, max_new_tokens: int) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)


def add_compile_argument(parser, *, what: str = "decode step") -> None:
    parser.add_argument(
        "--compile",
        action="store_true",
        help=f"run each {what} as one compiled graph (torch.compile: inductor; CUDA graphs on a GPU); the prefill "
        "and the evictions stay eager, the compilation's time is reported apart, and a cache that cannot be "
        "compiled (a quantized tier, a hybrid model) decodes eagerly and says why",
    )


def add_buffer_argument(parser, *, default: int = DEFAULT_BUFFER) -> None:
    """``--buffer B`` (one default for every command but the demo's)."""
    parser.add_argument(
        "--buffer",
        type=non_negative_argument,
        default=default,
        help=f"B: tokens added between evictions (default {default})",
    )


def non_negative_argument(text: str) -> int:
    """A non-negative integer, refused by the parser (naming the flag) before anything loads."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def positive_argument(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_or_all_argument(text: str) -> int | None:
    """A positive integer, or ``none`` / ``all`` (no limit: None)."""
    return None if text.lower() in ("none", "all") else positive_argument(text)


def fraction_argument(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def load_model_from(args: argparse.Namespace):
    """Load ``--model`` (transformers' loading bars only on a terminal, never under ``--no-progress`` or ``--json``)."""
    print(f"loading {args.model} ({args.dtype}, {args.device}, {args.attn}) ...", file=sys.stderr, flush=True)
    quiet = getattr(args, "no_progress", False) or getattr(args, "json", False)
    return load_model(
        args.model,
        dtype=args.dtype,
        device=args.device,
        attn_implementation=args.attn,
        progress=False if quiet else None,
    )


def budget_argument(text: str) -> int | None:
    """``--budget`` accepts a positive integer or ``none`` (no eviction)."""
    if text.lower() in ("none", "full"):
        return None
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"budget must be a positive integer, got {value}")
    return value


def _sandbox_limit(text: str, number, check, flag: str):
    """``text`` as a ``number`` passed through the sandbox's range ``check``; a value that is no number is
    handed to the check as it is, so that its message names it and the range."""
    try:
        value: object = number(text)
    except ValueError:
        value = text
    try:
        return check(value, flag)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def int_list_argument(text: str) -> list[int]:
    """Comma-separated integers (``--budgets 128,256``)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def positive_rate_argument(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens per second, got {text!r}")
    return value


# Seconds and MiB in the sandbox's allowed ranges, refused before anything loads.
code_timeout_argument = functools.partial(_sandbox_limit, number=float, check=check_timeout, flag="--code-timeout")
code_memory_argument = functools.partial(_sandbox_limit, number=int, check=check_memory, flag="--code-memory")
