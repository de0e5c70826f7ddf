"""Batched decoding with an evicting KV cache: prefill, then per step sample -> feed -> stop.

The cache evicts after every forward (:class:`~reasonkv.cache.evictor.Evictor`); this loop feeds, samples and
stops. Batches are left-padded; padding never takes budget and each row evicts on its own schedule, so a row's
result does not depend on its batch, up to rounding (a padded batch sums in another order).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from reasonkv.cache.decisions import DecisionLog
from reasonkv.cache.evicting import EvictingCache
from reasonkv.cache.spec import CacheSpec, resolve_spec
from reasonkv.generation.compiled import compile_backend
from reasonkv.generation.context import context_length, over_context
from reasonkv.generation.inputs import check_flags, encode_prompts, eos_ids, stop_strings, vocab_size
from reasonkv.generation.rows import Rows
from reasonkv.generation.sampling import Sampling
from reasonkv.generation.stats import GenerationResult, Meter
from reasonkv.generation.step import decode, open_step
from reasonkv.hf import left_pad
from reasonkv.policies import noise
from reasonkv.suggest.integers import is_int

__all__ = ["GenerationResult", "generate", "row_seeds"]


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
    spec: CacheSpec | None = None,
    *,
    policy=None,
    budget: int | None = None,
    buffer: int | None = None,
    quantized: int = 0,
    bits: int | None = None,
    group_size: int | None = None,
    seed: int | Sequence[int] | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    progress: bool = False,
    on_step: Callable[[int, EvictingCache], None] | None = None,
    sync_timing: bool = False,
    trace: bool = False,
    compile: bool | str = False,
    chat: bool = True,
    **policy_options,
) -> list[GenerationResult]:
    """Decode ``prompts`` (one batch) with a KV cache held to ``budget + buffer`` tokens per head.

    Parameters
    ----------
    tokenizer
        The model's tokenizer; may be ``None`` when prompts are token ids (outputs then have no text).
    prompts
        One prompt or a non-empty list of them: text (see ``chat``) or token ids inside the vocabulary.
    spec
        The cache's settings as one :class:`~reasonkv.cache.CacheSpec`; or give them as keywords (not
        both: a cache setting given twice is refused, naming it):
    policy, budget, buffer, quantized, bits, group_size, policy_options
        A registered policy name (see :func:`reasonkv.list_policies`) or instance (default ``full``),
        ``K`` and ``B`` (each row is shrunk to ``K`` tokens whenever it holds ``K + B``; ignored by
        ``full``, required by every other policy), a quantized tier of ``Q`` tokens per head at 8 or 4
        bits, and the policy's hyper-parameters (``sinks``, ``window``, ...). Pass a policy instance when
        an option shares its name with an argument of this function.
    seed
        The sampling's seed per row: one integer, or one per prompt; with keywords it seeds the eviction too,
        beside a spec the spec's own ``seed`` does (and the sampling, when ``seed`` is not given).
    max_new_tokens, temperature, top_p, top_k
        Decoding (see :class:`~reasonkv.generation.sampling.Sampling`; temperature 0: greedy). Past the model's
        context (``max_position_embeddings``) it decodes with a ``UserWarning`` (the commands refuse), and a
        row that went past says so: ``stats["past_context"] = {"context": ..., "tokens": <prompt + output>}``.
    stop
        A string, or a list of strings, that ends a row's generation (kept in its text).
    ignore_eos
        Decode exactly ``max_new_tokens`` (benchmarks).
    progress
        Show a progress bar over decode steps.
    on_step
        Called as ``on_step(step, cache)`` after every forward pass (prefill is step 0).
    sync_timing
        Synchronise CUDA around each eviction phase so ``stats["timings"]`` splits time exactly.
    trace
        Record every eviction: each result's ``trace`` is then a :class:`~reasonkv.cache.decisions.Trace`
        (what each layer and head held, protected and scored; see ``reasonkv inspect``).
    compile
        ``True`` or a ``torch.compile`` backend's name (default ``"inductor"``): each decode step one compiled
        graph (:class:`~reasonkv.generation.compiled.CompiledDecode`; prefill and evictions eager), its tracing
        left out of ``decode_seconds`` and reported in ``stats["compile"]`` (with why a cache decoded eagerly).
    chat
        Apply the tokenizer's chat template to text prompts (default, as ``reasonkv generate``), unless the
        tokenizer has none or the text already starts as the template renders. ``False``: the text as it is.
    """
    sampling = Sampling(max_new_tokens, temperature, top_p, top_k)
    check_flags(ignore_eos=ignore_eos, progress=progress, sync_timing=sync_timing, trace=trace, chat=chat)
    backend = compile_backend(compile)
    if on_step is not None and not callable(on_step):
        raise ValueError(f"on_step must be a function on_step(step, cache) or None, got {on_step!r}")
    stop = stop_strings(stop)
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    prompt_ids = encode_prompts(tokenizer, prompts, vocab_size(model), chat=chat)
    context = context_length(model)
    too_long = over_context(max(map(len, prompt_ids)), max_new_tokens, context, "the model's output past it is noise")
    if too_long is not None:
        warnings.warn(f"reasonkv.generate: {too_long}", UserWarning, stacklevel=3)
    seed = None if seed is None else row_seeds(seed, len(prompt_ids))
    cache_keywords = dict(policy=policy, budget=budget, buffer=buffer, quantized=quantized, bits=bits)
    if spec is None:  # the keyword API: the seed is the cache's too
        cache_keywords["seed"] = seed
    spec = resolve_spec(spec, **cache_keywords, group_size=group_size, **policy_options)
    spec = spec.replace(seed=row_seeds(spec.seed, len(prompt_ids)))
    if backend is not None:
        spec.check_compile()
    device = next(model.parameters()).device
    pad_id = 0 if getattr(tokenizer, "pad_token_id", None) is None else tokenizer.pad_token_id
    ids, mask = left_pad(prompt_ids, pad_id, device)

    cache = EvictingCache(model=model, spec=spec, sync_timing=sync_timing)
    cache.reserve(ids.shape[1] + max_new_tokens)
    log = DecisionLog(cache) if trace else None
    step = open_step(model, cache, backend)
    meter = Meter(cache, device, step)
    eos = set() if ignore_eos else eos_ids(model, tokenizer)
    rows = Rows(len(prompt_ids), device, tokenizer, eos, stop, clock=meter.clock)
    seeds = sampling.seeds(noise.seed_tensor(list(seed or spec.seed), len(prompt_ids), device))
    bar = tqdm(total=max_new_tokens, desc=f"{spec.policy.name} decode", leave=False, disable=not progress)

    def next_input(index: int, logits: torch.Tensor):
        """Sample step ``index``'s tokens; the next input, or None once every row stopped."""
        meter.step()
        bar.update(1)
        tokens = sampling.draw(logits, seeds, index)
        rows.take(tokens, cache)
        if rows.done or index == max_new_tokens - 1:
            return None
        return rows.next_input(tokens, pad_id)

    try:
        meter.started = meter.now()
        logits = step.prefill(ids, mask)
        del ids, mask  # the prompt's tensors: the decode's live memory stays flat in the context
        meter.prefilled = meter.now()
        if on_step is not None:
            on_step(0, cache)
        decode(step, logits, next_input, None if on_step is None else lambda index: on_step(index, cache))
        meter.stopped = meter.now()
    finally:
        bar.close()
        cache.detach()
        step.close()
    results = meter.results(rows, prompt_ids)
    for row, result in enumerate(results):
        tokens = result.prompt_tokens + result.num_tokens
        if context is not None and tokens > context:  # what the warning foresaw, as it happened to this row
            result.stats["past_context"] = {"context": context, "tokens": tokens}
        if backend is not None:
            result.stats["compile"] = step.describe()
        if log is not None:
            result.trace = log.trace(row)
    return results


def row_seeds(seed: int | Sequence[int], batch: int) -> tuple[int, ...]:
    """One integer seed per row, from one integer or a list with one per prompt."""
    if is_int(seed):
        return (seed,) * batch
    seeds = list(seed) if isinstance(seed, Iterable) and not isinstance(seed, (str, bytes)) else None
    if seeds is None or not all(map(is_int, seeds)):
        raise ValueError(f"seed must be an integer or a list of {batch} integers (one per prompt), got {seed!r}")
    if len(seeds) != batch:
        raise ValueError(f"seed has {len(seeds)} values for {batch} prompts; pass one integer or one per prompt")
    return tuple(seeds)
