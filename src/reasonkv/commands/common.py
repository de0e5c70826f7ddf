"""Arguments shared by commands: the model, the policy and its options."""

from __future__ import annotations

import argparse
import dataclasses
import sys

DEFAULT_MODEL = "smollm2-135m"


def add_model_arguments(parser: argparse.ArgumentParser, *, dtype: str = "fp32") -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"hub id, local directory, .gguf file, or {DEFAULT_MODEL} (default)"
    )
    group.add_argument("--dtype", default=dtype, help=f"fp32 | bf16 | fp16 (default {dtype})")
    group.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    group.add_argument("--attn", default="sdpa", help="sdpa (default) | flash_attention_2 | eager")


def add_policy_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy hyper-parameter, e.g. -o sinks=8 -o window=32 (repeatable; see `reasonkv policies`)",
    )


def load(args: argparse.Namespace):
    from reasonkv.models import load_model

    print(f"loading {args.model} ({args.dtype}, {args.device}, {args.attn}) ...", file=sys.stderr, flush=True)
    return load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)


def parse_options(policy: str, pairs: list[str]) -> dict[str, object]:
    """``["sinks=8", "sample=false"]`` -> typed keyword arguments for ``get_policy(policy, ...)``."""
    from reasonkv.policies import policy_class

    fields = {f.name: f for f in dataclasses.fields(policy_class(policy))}
    defaults = policy_class(policy).options()
    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"policy option {pair!r} is not KEY=VALUE")
        if key not in fields:
            raise ValueError(f"policy {policy!r} has no option {key!r}; options: {', '.join(sorted(fields))}")
        options[key] = _convert(key, text.strip(), defaults.get(key))
    return options


def _convert(key: str, text: str, default: object) -> object:
    if text.lower() in ("none", "null"):
        return None
    try:
        if isinstance(default, bool):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, (tuple, list)):
            return tuple(_scalar(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"option {key}={text!r}: expected {type(default).__name__}") from None
    if isinstance(default, str):
        return text
    return _scalar(text)


def _scalar(text: str) -> object:
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def budget_argument(text: str) -> int | None:
    """``--budget`` accepts a positive integer or ``none`` (no eviction)."""
    if text.lower() in ("none", "full"):
        return None
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"budget must be a positive integer, got {value}")
    return value
