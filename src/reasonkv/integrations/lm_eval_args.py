"""The ``--model_args`` of lm-eval's ``reasonkv`` model, read and checked before any model loads.

lm-eval hands them as keyword arguments, typed by its own parser or, from Python, as given: the cache's settings
and the policy's options as ``policy.KEY=VALUE`` (the spec built by :func:`~reasonkv.cache.spec.resolve_spec`, as
every command builds it), the model's, and lm-eval's HF-model settings that still apply (docs/lm-eval.md).
Anything else is refused by name, so a misspelt argument fails before a model loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reasonkv.cache.spec import CacheSpec, resolve_spec
from reasonkv.policies import Policy, parse_options, policy_class
from reasonkv.policies.options import field_types, split_option
from reasonkv.suggest.integers import is_int

__all__ = ["ALLOCATION_ARGS", "CACHE_ARGS", "HARNESS_ARGS", "MODEL_ARGS", "SCORING", "ModelArgs", "parse_model_args"]

SCORING = ("evicting", "full")
CACHE_ARGS = ("policy", "budget", "buffer", "quantized", "bits", "group_size", "seed")
ALLOCATION_ARGS = ("allocation", "budgets_file", "adaptive_alpha", "padded_heads")
MODEL_ARGS = ("pretrained", "tokenizer", "dtype", "device", "attn_implementation", "scoring")
# lm-eval's HF-model settings that keep their meaning; max_batch_size is what lm-eval passes with every model
# (for batch_size=auto, which reasonkv refuses) and is accepted to be ignored.
HARNESS_ARGS = (
    "batch_size",
    "max_batch_size",
    "max_length",
    "truncation",
    "add_bos_token",
    "prefix_token_id",
    "think_end_token",
    "enable_thinking",
    "chat_template_args",
)
_KNOWN = CACHE_ARGS + ALLOCATION_ARGS + MODEL_ARGS + HARNESS_ARGS


@dataclass(frozen=True)
class ModelArgs:
    """``--model_args``, checked: the cache's :class:`CacheSpec`, how to load the model, lm-eval's settings."""

    pretrained: Any
    spec: CacheSpec
    tokenizer: Any = None
    scoring: str = "evicting"
    dtype: str = "fp32"
    device: str | None = None  # None: cuda when there is one, else cpu
    attn_implementation: str = "sdpa"
    batch_size: int = 1
    harness: dict[str, Any] = field(default_factory=dict)


def parse_model_args(args: Mapping[str, Any]) -> ModelArgs:
    """Check ``args`` (lm-eval's ``--model_args`` as keywords) and build the cache's spec: ``ValueError`` naming
    the argument (unknown, an unknown policy or option, a wrong type, a budget too small, a bad scoring mode...)."""
    args = dict(args)
    policy = args.get("policy", "full")
    name = policy.name if isinstance(policy, Policy) else policy
    for key, value in args.items():
        if key not in _KNOWN and "." not in key:
            raise ValueError(_unknown(key, value, name))
    if not isinstance(policy, Policy):
        try:
            policy_class(policy if isinstance(policy, str) else repr(policy))
        except ValueError as error:
            raise ValueError(f"model_args policy={policy!r}: {error}") from None
    options = {}
    for key, value in args.items():
        if "." in key:
            options.update(_policy_option(name, key, value))
    nullable = ("budget", "bits", "group_size")
    cache = {name: _integer(name, args[name], none=name in nullable) for name in CACHE_ARGS[1:] if name in args}
    try:
        spec = resolve_spec(None, policy=policy, **cache, **_allocation(args), **options)
    except ValueError as error:
        raise ValueError(f"model_args: {error}") from None
    scoring = args.get("scoring", "evicting")
    if scoring not in SCORING:
        raise ValueError(
            f"model_args scoring={scoring!r}: expected 'evicting' (loglikelihoods through the evicting cache) "
            "or 'full' (lm-eval's own full-context scoring)"
        )
    batch_size = args.get("batch_size", 1)
    if isinstance(batch_size, str) and batch_size.strip().isdigit():
        batch_size = int(batch_size)
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(
            f"model_args batch_size={batch_size!r}: expected a positive integer (reasonkv sizes no batch "
            "automatically: its cache holds at most K + B tokens per row, so pick the batch the device fits)"
        )
    pretrained = args.get("pretrained", "smollm2-135m")
    if not isinstance(pretrained, str) and args.get("tokenizer") is None:
        raise ValueError("model_args pretrained=<a loaded model> needs its tokenizer= too")
    harness = {k: args[k] for k in HARNESS_ARGS if k in args and k not in ("batch_size", "max_batch_size")}
    loading = {k: args[k] for k in ("tokenizer", "dtype", "device", "attn_implementation") if k in args}
    return ModelArgs(pretrained, spec, scoring=scoring, batch_size=batch_size, harness=harness, **loading)


def _allocation(args: Mapping[str, Any]) -> dict[str, Any]:
    """The allocation's keywords of :func:`~reasonkv.cache.spec.resolve_spec` (None: not given), as the command
    line's ``--allocation``, ``--budgets-file``, ``--adaptive-alpha`` and ``--padded-heads`` give them."""
    alpha = args.get("adaptive_alpha")
    if isinstance(alpha, str):
        try:
            alpha = None if alpha.strip().lower() == "none" else float(alpha)
        except ValueError:
            raise ValueError(f"model_args adaptive_alpha={alpha!r}: expected a number") from None
    padded = args.get("padded_heads", False)
    if isinstance(padded, str) and padded.strip().lower() in ("true", "false"):
        padded = padded.strip().lower() == "true"
    if not isinstance(padded, bool):
        raise ValueError(f"model_args padded_heads={padded!r}: expected true or false")
    return {
        "allocation": args.get("allocation"),
        "budgets_file": args.get("budgets_file"),
        "adaptive_alpha": alpha,
        "ragged": False if padded else None,  # None: not given (refused only when given, off its allocation)
    }


def _policy_option(policy: str, key: str, value: Any) -> dict[str, Any]:
    """``policy.KEY=VALUE`` (or ``POLICY.KEY=VALUE``) as a typed option of ``policy``."""
    target, option, _ = split_option(f"{key}=")
    pair = f"{option}={_as_text(value)}" if target == "policy" else f"{key}={_as_text(value)}"
    try:
        return parse_options(policy, [pair])
    except ValueError as error:
        raise ValueError(f"model_args {key}={value!r}: {error}") from None


def _as_text(value: Any) -> str:
    """A value lm-eval's parser typed, as the text the option parser reads (lists as ``1,2``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(_as_text(v) for v in value)
    return str(value)


def _integer(name: str, value: Any, *, none: bool) -> int | None:
    """A given cache argument as an integer (text of digits is one); ``none`` also allows None / "none"."""
    if none and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
        return None
    if is_int(value):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    allowed = "an integer or none" if none else "an integer"
    raise ValueError(f"model_args {name}={value!r}: expected {allowed}")


def _unknown(key: str, value: Any, policy: Any) -> str:
    hint = ""
    with contextlib.suppress(ValueError):  # an unknown policy gives no hint
        if isinstance(policy, str) and key in field_types(policy_class(policy)):
            hint = f" (a policy option? write policy.{key}={_as_text(value)})"
    return (
        f"model_args {key}={value!r}: unknown argument{hint}; reasonkv's model takes {', '.join(_KNOWN)}, "
        "and policy.KEY=VALUE for the policy's options (`reasonkv policies` lists them)"
    )
