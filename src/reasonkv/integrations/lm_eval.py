"""lm-evaluation-harness's ``reasonkv`` model: any lm-eval task, decoded and scored through an evicting KV cache.

:class:`ReasonKVLM` is lm-eval's HuggingFace model (``HFLM``: tokenization, chat templates, stop sequences,
truncation) with the model loaded as reasonkv loads one and every request run through an evicting cache built
from one :class:`~reasonkv.cache.CacheSpec` (:mod:`reasonkv.integrations.lm_eval_args`): ``generate_until`` by
:func:`reasonkv.generate`, log-likelihoods teacher-forced through the cache
(:func:`reasonkv.eval.fidelity.teacher_force`) unless ``scoring=full``, one seed per request from its task,
document and repeat, and each request's statistics appended to its arguments as ``{"reasonkv": [...]}``
(docs/lm-eval.md). Importing this module registers it as ``--model reasonkv``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as error:
    if (error.name or "").split(".")[0] != "lm_eval":
        raise
    raise ModuleNotFoundError(
        "reasonkv's lm-eval model needs lm-evaluation-harness: pip install 'reasonkv[lm-eval]'", name="lm_eval"
    ) from error

from reasonkv import __version__
from reasonkv.eval.fidelity import teacher_force
from reasonkv.eval.units import sample_seed
from reasonkv.generation import GenerationResult, generate
from reasonkv.generation.stats import peak_row_tokens
from reasonkv.integrations.lm_eval_args import CACHE_ARGS, parse_model_args
from reasonkv.integrations.lm_eval_tasks import Generation
from reasonkv.models import load_model

__all__ = ["ANNOTATION", "TASKS_DIR", "ReasonKVLM"]

#: The local lm-eval tasks shipped with reasonkv (``--include_path``): reasonkv_gsm8k, reasonkv_math500, ...
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
#: The key of the statistics appended to each request's arguments.
ANNOTATION = "reasonkv"

# Generation settings that change nothing at these values (lm-eval tasks sometimes spell them out).
_NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "length_penalty": 1.0}
_NEUTRAL.update({"typical_p": 1.0, "no_repeat_ngram_size": 0, "min_p": 0.0, "use_cache": True})
# What transformers samples with when neither the task nor the model's generation config says.
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
# HFLM's notes about a model handed over already loaded: reasonkv loads it on purpose.
_LOADED_MODEL_NOTES = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")
# The generation statistics each logged sample keeps (the rest of GenerationResult.stats is timing detail).
_GENERATION_STATS = ("policy", "budget", "buffer", "quantized", "bits", "evictions", "peak_row_tokens")
_GENERATION_STATS += ("peak_slots", "peak_kv_bytes", "batch_size")


@register_model("reasonkv")
class ReasonKVLM(HFLM):
    """lm-eval's HF model on reasonkv's evicting cache; ``model_args``: see :mod:`~reasonkv.integrations.lm_eval_args`.

    Examples
    --------
    >>> lm = ReasonKVLM("smollm2-135m", policy="streaming", budget=256, buffer=64, **{"policy.sinks": 8})
    >>> lm_eval.simple_evaluate(model=lm, tasks=["reasonkv_gsm8k"], task_manager=TaskManager(include_path=...))
    """

    def __init__(self, pretrained: Any = "smollm2-135m", **model_args: Any) -> None:
        args = parse_model_args({"pretrained": pretrained, **model_args})
        if isinstance(args.pretrained, str):
            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            model, tokenizer = load_model(
                args.pretrained, dtype=args.dtype, device=device, attn_implementation=args.attn_implementation
            )
        else:
            model, tokenizer = args.pretrained, None
        tokenizer = args.tokenizer if args.tokenizer is not None else tokenizer
        if tokenizer is None:
            raise ValueError(
                f"model_args pretrained={args.pretrained!r}: lm-eval needs text, and this model has no tokenizer"
            )

        def quiet(record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(_LOADED_MODEL_NOTES)

        hf_log = logging.getLogger(HFLM.__module__)
        hf_log.addFilter(quiet)
        try:
            super().__init__(
                pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=args.batch_size, **args.harness
            )
        finally:
            hf_log.removeFilter(quiet)
        self.pretrained = args.pretrained if isinstance(args.pretrained, str) else model.name_or_path
        self.spec, self.scoring = args.spec, args.scoring

    @property
    def settings(self) -> dict[str, Any]:
        """reasonkv's settings, written into lm-eval's results (``config.reasonkv``)."""
        spec = self.spec
        options = {f.name: getattr(spec.policy, f.name) for f in dataclasses.fields(spec.policy)}
        cache = {name: getattr(spec, name) for name in CACHE_ARGS[1:]}
        # how the budget is shared among layers and kv-heads (nothing under uniform)
        shared = ("allocation", "budgets_file", "adaptive_alpha", "ragged") if spec.allocated else ()
        cache.update({name: getattr(spec, name) for name in shared if getattr(spec, name) is not None})
        head = {"version": __version__, "pretrained": self.pretrained, "policy": spec.policy.name, "options": options}
        return {**head, **cache, "scoring": self.scoring}

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "model_revision": "",
            "model_sha": "",  # nothing to look up on a hub: the model may be bundled, local or a GGUF file
            ANNOTATION: self.settings,
        }

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        texts: list[str] = [""] * len(requests)
        stats: list[dict] = [{}] * len(requests)
        seeds = self._seeds(requests)
        groups: dict[str, list[int]] = defaultdict(list)  # one batch never mixes generation settings
        for i, request in enumerate(requests):
            groups[json.dumps(_args(request)[1], sort_keys=True, default=str)].append(i)
        bar = tqdm(total=len(requests), desc="reasonkv generate_until", disable=disable_tqdm or self.rank != 0)
        for indices in groups.values():
            # longest prompt first, as lm-eval's HF model batches: the padding within a batch stays small
            indices.sort(key=lambda i: (-len(self.tok_encode(_args(requests[i])[0])), _args(requests[i])[0]))
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start : start + self.batch_size]
                contexts = [_args(requests[i])[0] for i in batch]
                settings = _args(requests[batch[0]])[1]
                generated = self._generate(contexts, settings, [seeds[i] for i in batch])
                for i, (text, row) in zip(batch, generated, strict=True):
                    texts[i], stats[i] = text, row
                    self.cache_hook.add_partial("generate_until", _args(requests[i])[:2], text)
                bar.update(len(batch))
        bar.close()
        _annotate(requests, stats)
        return texts

    def _generate(self, contexts: list[str], settings: dict, seeds: list[int]) -> list[tuple[str, dict]]:
        """One batch: lm-eval's encoding and truncation, reasonkv's decoding, lm-eval's post-processing."""
        kwargs = dict(normalize_gen_kwargs(settings, self.max_gen_toks))
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        if max_gen_toks >= self.max_length:
            raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for a prompt in max_length={self.max_length}")
        ids, mask = self.tok_batch_encode(
            contexts, left_truncate_len=self.max_length - max_gen_toks, truncation=self.truncation
        )
        prompts = [row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True)]
        spec = self.spec.replace(seed=tuple(seeds))
        stop = [s for s in until if s] or None
        results = generate(
            self.model, self.tokenizer, prompts, spec, max_new_tokens=max_gen_toks, stop=stop, **self._sampling(kwargs)
        )
        return [
            (self._text(result, until), _generation_stats(result, seed))
            for result, seed in zip(results, seeds, strict=True)
        ]

    def _sampling(self, kwargs: dict) -> dict[str, Any]:
        """lm-eval's normalised generation settings as ``reasonkv.generate``'s ``temperature``/``top_p``/``top_k``."""
        do_sample = kwargs.pop("do_sample", False)
        given = {name: kwargs.pop(name) for name in _SAMPLING_DEFAULTS if name in kwargs}
        unsupported = {k: v for k, v in kwargs.items() if k not in _NEUTRAL or _NEUTRAL[k] != v}
        if unsupported:
            raise ValueError(
                f"generation setting(s) {unsupported} are not implemented by reasonkv's decoding, which takes "
                "do_sample, temperature, top_p, top_k, until and max_gen_toks"
            )
        if not do_sample or given.get("temperature") == 0:
            return {"temperature": 0.0}
        config = getattr(self.model, "generation_config", None)
        sampling = {}
        for name, default in _SAMPLING_DEFAULTS.items():  # each cast to its default's type (top_k an int)
            value = given.get(name, getattr(config, name, None))
            sampling[name] = type(default)(default if value is None else value)
        return sampling

    def _text(self, result: GenerationResult, until: list[str]) -> Generation:
        """The continuation as lm-eval's HF model returns it: after a thinking block, cut at the first stop; it
        says how decoding ended, so the task's grader never takes the last number of a cut-off output."""
        tokens = result.token_ids
        if isinstance(self.think_end_token, int) and self.think_end_token in tokens:
            tokens = tokens[len(tokens) - tokens[::-1].index(self.think_end_token) :]
        text = self.tok_decode(tokens)
        if isinstance(self.think_end_token, int):
            text = text.lstrip()
        think = self.think_end_token if isinstance(self.think_end_token, str) else None
        text = postprocess_generated_text(generation=text, stop=until, think_end_token=think)
        return Generation(text, result.finish_reason)

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.enable_thinking:
            raise ValueError("enable_thinking=True works with generative tasks only, not loglikelihood ones")
        pairs = [self._encode(*_args(request)[:2]) for request in requests]
        scored = self._score(pairs, self._seeds(requests), disable_tqdm)
        for request, (logprob, greedy, _) in zip(requests, scored, strict=True):
            self.cache_hook.add_partial("loglikelihood", _args(request)[:2], (logprob, greedy))
        _annotate(requests, [row for _, _, row in scored])
        return [(logprob, greedy) for logprob, greedy, _ in scored]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in lm-eval's disjoint windows of ``max_length`` tokens."""
        windows, owners, seeds = [], [], []
        for i, (request, seed) in enumerate(zip(requests, self._seeds(requests), strict=True)):
            tokens = self.tok_encode(_args(request)[0])
            for j, window in enumerate(get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)):
                windows.append(make_disjoint_window(window))
                owners.append(i)
                seeds.append(sample_seed(seed, "window", j))
        totals = [0.0] * len(requests)
        stats: list[dict] = [{"windows": 0} for _ in requests]
        for i, (logprob, _, row) in zip(owners, self._score(windows, seeds, disable_tqdm), strict=True):
            totals[i] += logprob
            stats[i] = _merge_windows(stats[i], row)
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", _args(request)[:1], total)
        _annotate(requests, stats)
        return totals

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None):
        """lm-eval's scoring entry point on encoded requests ``(strings, context_ids, continuation_ids)``."""
        pairs = [(context, continuation) for _, context, continuation in requests]
        scored = self._score(
            pairs, [sample_seed(self.spec.seed, "request", i) for i in range(len(pairs))], disable_tqdm
        )
        return [(logprob, greedy) for logprob, greedy, _ in scored]

    def _encode(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation token ids, as lm-eval's models split them (an empty context: the prefix token)."""
        if context:
            return self._encode_pair(context, continuation)
        tokens = self.tok_encode(continuation, add_special_tokens=False)
        if tokens and tokens[0] == self.prefix_token_id:
            return tokens[:1], tokens[1:]
        return [self.prefix_token_id], tokens

    def _score(self, pairs: Sequence[tuple[list[int], list[int]]], seeds: list[int], disable_tqdm: bool):
        """``(log-probability, greedy?, statistics)`` of each ``(context, continuation)`` pair."""
        if self.scoring == "full":
            requests = [((None, None), context, continuation) for context, continuation in pairs]
            values = HFLM._loglikelihood_tokens(self, requests, disable_tqdm=disable_tqdm)
            return [(lp, greedy, _full_stats(c, x)) for (lp, greedy), (c, x) in zip(values, pairs, strict=True)]
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        scored: list = [None] * len(pairs)
        bar = tqdm(total=len(pairs), desc="reasonkv loglikelihood", disable=disable_tqdm or self.rank != 0)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            rows = [self._fit(*pairs[i]) for i in batch]
            for i, result in zip(batch, self._score_batch(rows, [seeds[i] for i in batch]), strict=True):
                scored[i] = result
            bar.update(len(batch))
        bar.close()
        return scored

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Cut the context from the left so that it and the continuation fit ``max_length`` (as lm-eval's HF model)."""
        if not continuation:
            raise ValueError("a loglikelihood request has an empty continuation")
        if len(continuation) > self.max_length:
            raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length={self.max_length}")
        whole = (context + continuation)[-(self.max_length + 1) :]
        return whole[: len(whole) - len(continuation)], continuation

    def _score_batch(self, rows: list[tuple[list[int], list[int]]], seeds: list[int]) -> list[tuple[float, bool, dict]]:
        """One batch teacher-forced through the evicting cache."""
        logprob, greedy = [0.0] * len(rows), [True] * len(rows)

        def consume(start: int, logits: torch.Tensor, _reference, active: list[int]) -> None:
            for r in active:
                target = torch.tensor(rows[r][1][start : start + logits.shape[1]], device=logits.device)
                logp = logits[r, : len(target)].float().log_softmax(-1)
                logprob[r] += float(logp.gather(-1, target.unsqueeze(-1)).sum())
                greedy[r] = greedy[r] and bool((logp.argmax(-1) == target).all())

        spec = self.spec.replace(seed=tuple(seeds))
        contexts, continuations = zip(*rows, strict=True)
        pad_id = self.tokenizer.pad_token_id or 0
        run = teacher_force(self.model, contexts, continuations, spec, consume=consume, pad_id=pad_id, reference=False)
        results = []
        for r, (context, continuation) in enumerate(rows):
            evictions = run.evictions[r]
            row = {"scoring": "evicting", "policy": spec.policy.name, "budget": spec.budget, "buffer": spec.buffer}
            row.update(quantized=spec.quantized, evictions=evictions)
            row["peak_row_tokens"] = peak_row_tokens(len(context), len(continuation), evictions, spec)
            row.update(peak_slots=run.peak_slots, kv_bytes=run.kv_bytes, batch_size=len(rows), seed=seeds[r])
            row.update(context_tokens=len(context), continuation_tokens=len(continuation))
            results.append((logprob[r], greedy[r], row))
        return results

    def _seeds(self, requests: Sequence) -> list[int]:
        """One seed per request from ``seed``, its task, document, index and repeat (not its place in the list)."""
        seen: Counter[int] = Counter()
        seeds = []
        for i, request in enumerate(requests):
            task = getattr(request, "task_name", None)
            key = f"{task}/{request.doc_id}/{request.idx}" if task is not None else f"request/{i}"
            seeds.append(sample_seed(self.spec.seed, key, seen[id(request)]))
            seen[id(request)] += 1
        return seeds


def _args(request) -> tuple:
    """A request's arguments without the statistics an earlier run appended."""
    args = request.args
    if args and isinstance(args[-1], dict) and set(args[-1]) == {ANNOTATION}:
        return args[:-1]
    return args


def _annotate(requests: Sequence, stats: Sequence[dict]) -> None:
    """Append ``{"reasonkv": [...]}`` to each request's arguments: one dict per response (a request repeated k
    times in ``requests`` gets k responses, in order)."""
    per_request: dict[int, list[dict]] = defaultdict(list)
    unique = {}
    for request, row in zip(requests, stats, strict=True):
        per_request[id(request)].append(row)
        unique[id(request)] = request
    for key, request in unique.items():
        request.arguments = (*_args(request), {ANNOTATION: per_request[key]})


def _generation_stats(result: GenerationResult, seed: int) -> dict[str, Any]:
    row = {key: result.stats[key] for key in _GENERATION_STATS}
    row.update(prompt_tokens=result.prompt_tokens, new_tokens=result.num_tokens, finish_reason=result.finish_reason)
    row["seed"] = seed
    return row


def _full_stats(context: list[int], continuation: list[int]) -> dict[str, Any]:
    return {"scoring": "full", "evictions": 0, "context_tokens": len(context), "continuation_tokens": len(continuation)}


def _merge_windows(total: dict, window: dict) -> dict:
    """A rolling request's statistics over its windows: counts summed, peaks the largest."""
    if not total["windows"]:
        return {**window, "windows": 1}
    merged = {**total, "windows": total["windows"] + 1}
    for key in ("evictions", "context_tokens", "continuation_tokens"):
        merged[key] = total[key] + window[key]
    for key in ("peak_row_tokens", "peak_slots", "kv_bytes"):
        if key in window:
            merged[key] = max(total[key], window[key])
    return merged
