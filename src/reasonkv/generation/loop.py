"""Batched decoding with an evicting KV cache: prefill, step, evict, stop.

The eviction itself happens in the hooks of :class:`~reasonkv.cache.evictor.Evictor`; this loop only
feeds tokens, samples, and measures. Batches are left-padded; padding never occupies budget, and
each row evicts on its own schedule, so a row's result does not depend on its batch up to rounding:
a padded batch sums in another order than a lone row (logits differ by about 1e-7 in float32, a unit
or two in the last place in bf16, where a near-tie can then send a greedy decode another way).
"""

from __future__ import annotations

import math
import numbers
import operator
import resource
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from reasonkv.policies import noise
from reasonkv.cache import EvictingCache
from reasonkv.hf import Forward, left_pad, synchronize

__all__ = ["GenerationResult", "generate"]

_SAMPLING_STREAM = 2  # keeps token sampling's draws apart from the eviction's


@dataclass
class GenerationResult:
    """One prompt's output.

    ``stats`` counts what happened while this row was live (from its prompt to its last token), so a
    prompt gets the same per-row figures in a batch as alone: ``evictions``, ``peak_row_tokens``
    (the most tokens this row's cache held at once), ``decode_seconds`` (from the end of prefill to
    this row's last token) and ``tokens_per_second`` (the tokens after the first, which prefill
    yields, over ``decode_seconds``; NaN for a one-token output). Shared by the batch:
    ``prefill_seconds``, ``peak_slots`` (cache slots, padding included), ``batch_size``,
    ``peak_kv_bytes`` (K/V storage held), ``peak_kv_bytes_by_tier`` (that peak's full-attention K/V
    split into ``full`` and ``quantized``), ``peak_memory_bytes`` (CUDA max allocated, or the
    process's peak RSS on CPU), ``timings`` (seconds per eviction phase), ``budget``, ``buffer``,
    ``quantized``, ``bits`` and ``policy``.
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


def _prompt_list(prompts) -> list:
    """``prompts`` as a list of prompts: one string or one token-id sequence counts as a batch of one."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts is None or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a string, a list of strings or a list of token-id lists, got {prompts!r}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    return [prompts] if _is_token_id(prompts[0]) else prompts


def _encode(tokenizer, prompts: list, vocab_size: int | None) -> list[list[int]]:
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass token-id lists when tokenizer is None")
            bos = getattr(tokenizer, "bos_token", None)
            add_special = not (bos and prompt.startswith(bos))  # chat templates already hold the BOS
            ids = list(tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
        elif isinstance(prompt, Iterable) and all(_is_token_id(t) for t in prompt):
            ids = [operator.index(t) for t in prompt]
        else:
            raise ValueError(f"prompts[{i}] must be a string or a list of integer token ids, got {prompt!r}")
        if not ids:
            raise ValueError(f"prompts[{i}] is empty")
        outside = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if outside:
            allowed = "ids >= 0" if vocab_size is None else f"the model's vocabulary is 0..{vocab_size - 1}"
            raise ValueError(f"prompts[{i}] holds token id {outside[0]}, outside the vocabulary ({allowed})")
        encoded.append(ids)
    return encoded


def _is_token_id(value) -> bool:
    """An integer (Python, numpy or a 0-d integer tensor), not a bool."""
    if isinstance(value, (bool, str)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _vocab_size(model) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seeds: torch.Tensor, step: int
) -> torch.Tensor:
    """One token per row. Row ``i``'s draw is keyed by ``seeds[i]`` and ``step`` alone (inverse CDF of one
    uniform number), so it does not depend on the batch, and no per-row call or host read is needed."""
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
    cdf = logits.softmax(-1).double().cumsum(-1)
    draw = noise.uniform(noise.mix(seeds, step), torch.float64).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw).clamp(max=logits.shape[-1] - 1).squeeze(1)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    if not _is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    real = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
    if not real or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    real = isinstance(top_p, numbers.Real) and not isinstance(top_p, bool)
    if not real or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0 = off), got {top_k!r}")


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list: one string is one stop string, not a list of characters."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, Iterable) else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if "" in stops:
        raise ValueError("stop strings must not be empty: '' would end every row at its first token")
    return stops


def _row_seeds(seed: int | Sequence[int], batch: int) -> list[int]:
    """One integer seed per row, from one integer or a list with one per prompt."""
    if _is_int(seed):
        return [int(seed)] * batch
    seeds = list(seed) if isinstance(seed, Iterable) and not isinstance(seed, (str, bytes)) else None
    if seeds is None or not all(_is_int(s) for s in seeds):
        raise ValueError(f"seed must be an integer or a list of {batch} integers (one per prompt), got {seed!r}")
    if len(seeds) != batch:
        raise ValueError(f"seed has {len(seeds)} values for {batch} prompts; pass one integer or one per prompt")
    return [int(s) for s in seeds]


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
    seed: int | Sequence[int] = 0,
    stop: str | Sequence[str] | None = None,
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
        One prompt or a non-empty list of them: text (already chat-formatted if the model expects
        it) or token ids inside the model's vocabulary.
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
        Seeds the eviction randomness and the sampling, per row: one integer for every row, or a list
        with one integer per prompt.
    stop
        A string, or a list of strings, that ends a row's generation (kept in its text). One string
        is one stop string; empty strings are refused.
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
    check_sampling(max_new_tokens, temperature, top_p, top_k)
    _check_flags(ignore_eos=ignore_eos, progress=progress, sync_timing=sync_timing)
    if on_step is not None and not callable(on_step):
        raise ValueError(f"on_step must be a function on_step(step, cache) or None, got {on_step!r}")
    stop = stop_strings(stop)
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    prompt_ids = _encode(tokenizer, _prompt_list(prompts), _vocab_size(model))
    seed = _row_seeds(seed, len(prompt_ids))
    device = next(model.parameters()).device
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else pad_id
    ids, mask = left_pad(prompt_ids, pad_id, device)
    batch = ids.shape[0]
    eos = set() if ignore_eos else _eos_ids(model, tokenizer)

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
    cache.reserve(ids.shape[1] + max_new_tokens)
    sampling_seeds = noise.mix(noise.seed_tensor(seed, batch, device), _SAMPLING_STREAM)
    alive = torch.ones(batch, dtype=torch.bool, device=device)  # rows still generating
    forward = Forward(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    generated = [[] for _ in range(batch)]
    finish = [None] * batch
    ended: list[tuple[float, int] | None] = [None] * batch  # per row: (time, evictions) when it ended
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
            held = cache.kv_bytes()
            if held > peak_kv:
                peak_kv, peak_tiers = held, cache.kv_bytes_by_tier()
            next_ids = _sample(out.logits[:, -1], temperature, top_p, top_k, sampling_seeds, step)
            for i, token in enumerate(next_ids.tolist()):  # the one read of each step: the tokens
                if finish[i] is not None:
                    continue
                generated[i].append(token)
                if token in eos:
                    finish[i] = "eos"
                elif stop and _hit_stop(tokenizer, generated[i], stop):
                    finish[i] = "stop"
                if finish[i] is not None:
                    alive[i] = False
            _mark_ended(ended, finish, cache)
            if all(f is not None for f in finish) or step == max_new_tokens - 1:
                break
            # A finished row is fed padding, which the cache neither stores as a token nor evicts for.
            done = any(f is not None for f in finish)
            next_ids = next_ids.masked_fill(~alive, pad_id) if done else next_ids
            mask = alive.unsqueeze(1) if done else None
            out = forward(next_ids.unsqueeze(1), cache, attention_mask=mask, last_logits_only=True)
            if on_step is not None:
                on_step(step + 1, cache)
        synchronize(device)
        t2 = time.perf_counter()
    finally:
        cache.detach()

    final_evictions = cache.row_evictions.tolist()
    ended = [e or (t2, final_evictions[i]) for i, e in enumerate(ended)]  # rows cut by max_new_tokens
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
        ended_at, evictions = ended[i]
        decode_seconds = ended_at - t1
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
                    "evictions": evictions,
                    "peak_row_tokens": _peak_row_tokens(len(prompt_ids[i]), len(tokens), evictions, cache),
                    "peak_slots": cache.peak_slots,
                    "prefill_seconds": t1 - t0,
                    "decode_seconds": decode_seconds,
                    "tokens_per_second": (len(tokens) - 1) / decode_seconds if len(tokens) > 1 else float("nan"),
                    "batch_size": batch,
                    "peak_kv_bytes": peak_kv,
                    "peak_kv_bytes_by_tier": peak_tiers,
                    "peak_memory_bytes": int(peak_memory),
                    "timings": cache.evictor.timings,
                },
            )
        )
    return results


def _mark_ended(ended: list, finish: list, cache: EvictingCache) -> None:
    """Note when the rows that just finished ended, and their evictions so far: later steps only pad them."""
    new = [i for i, f in enumerate(finish) if f is not None and ended[i] is None]
    if new:
        now, evictions = time.perf_counter(), cache.row_evictions.tolist()
        for i in new:
            ended[i] = (now, evictions[i])


def _peak_row_tokens(prompt_tokens: int, output_tokens: int, evictions: int, cache: EvictingCache) -> int:
    """The most tokens a row held at once: every token fed while it was live (the last sampled one never
    is) until its first eviction; after one, ``K + B``, the trigger (or the whole prompt, if longer), plus
    the ``Q`` of a quantized tier."""
    if evictions == 0:
        return prompt_tokens + max(output_tokens - 1, 0)
    return max(prompt_tokens, cache.budget + cache.buffer + cache.quantized)


def _hit_stop(tokenizer, tokens: list[int], stop: list[str]) -> bool:
    tail = tokenizer.decode(tokens[-(max(map(len, stop)) + 8) :], skip_special_tokens=True)
    return any(s in tail for s in stop)


def _cut_at_stop(text: str, stop: list[str]) -> str:
    ends = [text.find(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text
