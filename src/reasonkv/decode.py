"""Batched decoding with an evicting KV cache: prefill, step, evict, stop.

The eviction itself happens in the hooks of :class:`~reasonkv.evictor.Evictor`; this loop only
feeds tokens, samples, and measures. Batches are left-padded; padding never occupies budget, and
each row evicts on its own schedule, so a prompt gives the same tokens in a batch as alone.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from reasonkv.cache import EvictingCache
from reasonkv.evictor import row_generators
from reasonkv.hf import Forward, left_pad, synchronize

__all__ = ["GenerationResult", "generate"]


@dataclass
class GenerationResult:
    """One prompt's output.

    ``stats`` holds: ``evictions`` (this row), ``peak_slots`` (cache slots, whole batch),
    ``prefill_seconds``, ``decode_seconds``, ``tokens_per_second`` (this row's tokens over the batch's
    decode time), ``batch_size``, ``peak_kv_bytes`` (K/V storage held), ``peak_kv_bytes_by_tier``
    (that peak split into ``full`` and ``quantized``), ``peak_memory_bytes`` (CUDA max allocated, or
    the process's peak RSS on CPU), ``budget``, ``buffer``, ``quantized``, ``bits`` and ``policy``.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "stop" or "length"
    stats: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    return ids


def _encode(tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass token-id lists when tokenizer is None")
            bos = getattr(tokenizer, "bos_token", None)
            add_special = not (bos and prompt.startswith(bos))  # chat templates already hold the BOS
            encoded.append(tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
        else:
            encoded.append([int(t) for t in prompt])
        if not encoded[-1]:
            raise ValueError("empty prompt")
    return encoded


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generators: list[torch.Generator]
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])


def _check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
    *,
    policy="full",
    budget: int | None = None,
    buffer: int = 128,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | list[int] = 0,
    stop: Sequence[str] | None = None,
    ignore_eos: bool = False,
    progress: bool = False,
    on_step: Callable[[int, EvictingCache], None] | None = None,
    sync_timing: bool = False,
    quantized: int = 0,
    bits: int | None = None,
    group_size: int | None = None,
    **policy_kwargs,
) -> list[GenerationResult]:
    """Decode ``prompts`` (one batch) with a KV cache held to ``budget + buffer`` tokens per head.

    Parameters
    ----------
    tokenizer
        The model's tokenizer; may be ``None`` when prompts are token ids (outputs then have no text).
    prompts
        Text (already chat-formatted if the model expects it) or token-id lists.
    policy
        A registered policy name (see :func:`reasonkv.list_policies`) or instance. Pass an instance
        (``reasonkv.get_policy("vase-attnv", temperature=0.5)``) when a policy option shares its name
        with an argument of this function.
    budget, buffer
        ``K`` and ``B``: each row is shrunk to ``K`` tokens whenever it holds ``K + B``.
        Ignored by ``full``; required by every other policy.
    quantized, bits, group_size
        A quantized tier of ``Q`` tokens per head beside the ``K`` full-precision ones, int8 or
        int4 (see :class:`~reasonkv.cache.EvictingCache`; default: none).
    seed
        Seeds the eviction randomness and the sampling, per row (an int for all rows, or a list).
    stop
        Strings that end a row's generation (kept in its text).
    ignore_eos
        Decode exactly ``max_new_tokens`` (benchmarks).
    progress
        Show a progress bar over decode steps.
    on_step
        Called as ``on_step(step, cache)`` after every forward pass (prefill is step 0).
    sync_timing
        Synchronise CUDA around each eviction phase so ``stats["timings"]`` splits time exactly.
    policy_kwargs
        The policy's hyper-parameters (``sinks``, ``window``, ...).
    """
    _check_sampling(max_new_tokens, temperature, top_p, top_k)
    single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
    prompt_ids = _encode(tokenizer, [prompts] if single else prompts)
    device = next(model.parameters()).device
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else pad_id
    ids, mask = left_pad(prompt_ids, pad_id, device)
    batch = ids.shape[0]
    eos = set() if ignore_eos else _eos_ids(model, tokenizer)
    stop = list(stop or [])
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")

    cache = EvictingCache(
        budget,
        buffer,
        model=model,
        policy=policy,
        seed=seed,
        sync_timing=sync_timing,
        quantized=quantized,
        bits=bits,
        group_size=group_size,
        **policy_kwargs,
    )
    sampling_generators = row_generators(seed, batch, device, salt=2)
    forward = Forward(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    generated = [[] for _ in range(batch)]
    finish = [None] * batch
    peak_kv, peak_tiers = 0, cache.kv_bytes_by_tier()
    try:
        synchronize(device)
        t0 = time.perf_counter()
        out = forward(ids, cache, attention_mask=mask, last_logits_only=True)
        synchronize(device)
        t1 = time.perf_counter()
        if on_step is not None:
            on_step(0, cache)
        steps = range(max_new_tokens)
        if progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc=f"{cache.evictor.policy.name} decode", unit="tok", leave=False)
        for step in steps:
            tiers = cache.kv_bytes_by_tier()
            if sum(tiers.values()) > peak_kv:
                peak_kv, peak_tiers = sum(tiers.values()), tiers
            next_ids = _sample(out.logits[:, -1], temperature, top_p, top_k, sampling_generators)
            for i, token in enumerate(next_ids.tolist()):
                if finish[i] is not None:
                    continue
                generated[i].append(token)
                if token in eos:
                    finish[i] = "eos"
                elif stop and _hit_stop(tokenizer, generated[i], stop):
                    finish[i] = "stop"
            if all(f is not None for f in finish) or step == max_new_tokens - 1:
                break
            next_ids = next_ids.masked_fill(torch.tensor([f is not None for f in finish], device=device), pad_id)
            out = forward(next_ids.unsqueeze(1), cache, last_logits_only=True)
            if on_step is not None:
                on_step(step + 1, cache)
        synchronize(device)
        t2 = time.perf_counter()
    finally:
        cache.detach()

    decode_seconds = t2 - t1
    peak_memory = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    results = []
    for i in range(batch):
        tokens = generated[i]
        text_tokens = tokens[:-1] if finish[i] == "eos" else tokens
        text = "" if tokenizer is None else tokenizer.decode(text_tokens, skip_special_tokens=True)
        if finish[i] == "stop":
            text = _cut_at_stop(text, stop)
        results.append(
            GenerationResult(
                text=text,
                token_ids=tokens,
                prompt_tokens=len(prompt_ids[i]),
                finish_reason=finish[i] or "length",
                stats={
                    "policy": cache.evictor.policy.name,
                    "budget": cache.budget,
                    "buffer": buffer,
                    "quantized": cache.quantized,
                    "bits": cache.bits,
                    "evictions": int(cache.row_evictions[i]),
                    "peak_slots": cache.peak_slots,
                    "prefill_seconds": t1 - t0,
                    "decode_seconds": decode_seconds,
                    "tokens_per_second": len(tokens) / decode_seconds if decode_seconds > 0 else float("nan"),
                    "batch_size": batch,
                    "peak_kv_bytes": peak_kv,
                    "peak_kv_bytes_by_tier": peak_tiers,
                    "peak_memory_bytes": int(peak_memory),
                    "timings": cache.evictor.timings,
                },
            )
        )
    return results


def _hit_stop(tokenizer, tokens: list[int], stop: list[str]) -> bool:
    tail = tokenizer.decode(tokens[-(max(map(len, stop)) + 8) :], skip_special_tokens=True)
    return any(s in tail for s in stop)


def _cut_at_stop(text: str, stop: list[str]) -> str:
    ends = [text.find(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text
