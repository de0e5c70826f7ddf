"""Fidelity to the full cache: teacher-forced replays, top-1 agreement, KL, reference-answer log-probs."""

from __future__ import annotations

import math

import pytest
import torch

import reasonkv
from conftest import CharTokenizer, tiny_llama, tiny_qwen3
from reasonkv.eval.datasets import Problem
from reasonkv.eval.fidelity import (
    answer_logprob,
    answer_span,
    reference_continuation,
    replay_logits,
    trace_fidelity,
)
from reasonkv.hf import cache_keyword

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ids(n: int, seed: int, low: int = 3, high: int = 96) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


PROMPT = _ids(9, 1)
TRACE = _ids(40, 2)


@torch.inference_mode()
def _manual_stepwise(model, prompt, continuation, policy, budget, buffer, seed):
    """Independent reference: prefill, then one token per forward, as generation does."""
    cache = reasonkv.EvictingCache(budget, buffer, model=model, policy=policy, seed=seed)
    key = cache_keyword(model)
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, **{key: cache})
    logits = [out.logits[0, -1]]
    for token in continuation[:-1]:
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{key: cache})
        logits.append(out.logits[0, -1])
    cache.detach()
    return torch.stack(logits).float(), cache.evictions


def _count_forwards(model):
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen3])
@pytest.mark.parametrize("policy", ["streaming", "random"])
def test_chunked_replay_equals_stepwise_replay(factory, policy):
    model = factory()
    budget, buffer = 10, 4
    want, evictions = _manual_stepwise(model, PROMPT, TRACE, policy, budget, buffer, seed=7)
    assert evictions > 3

    calls, handle = _count_forwards(model)
    stepwise = replay_logits(model, PROMPT, TRACE, policy=policy, budget=budget, buffer=buffer, seed=7, chunked=False)
    step_calls = len(calls)
    calls.clear()
    chunked = replay_logits(model, PROMPT, TRACE, policy=policy, budget=budget, buffer=buffer, seed=7, chunked=True)
    chunk_calls = len(calls)
    handle.remove()

    assert type(reasonkv.get_policy(policy)).chunk_exact
    assert stepwise.evicting.shape == chunked.evicting.shape == (len(TRACE), model.config.vocab_size)
    torch.testing.assert_close(stepwise.evicting, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(chunked.evicting, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(chunked.evicting, stepwise.evicting, atol=1e-4, rtol=0)
    assert chunked.evictions == stepwise.evictions == evictions
    # the chunked replay really used fewer forward passes: per side, prefill + about one per B tokens
    fed = len(TRACE) - 1
    assert step_calls == 2 + fed + 1  # prefills, one step per token, one chunk on the full side
    assert chunk_calls <= 2 * (1 + math.ceil(fed / buffer) + 1)


CHUNK_EXACT = [
    n for n in reasonkv.list_policies() if reasonkv.get_policy(n).evicts and type(reasonkv.get_policy(n)).chunk_exact
]


@pytest.mark.parametrize("name", CHUNK_EXACT)
def test_every_policy_that_claims_chunk_exact_replays_chunked_as_stepwise(name):
    # The fidelity replay trusts the claim; check it for the whole registry (budgets as in the contract table).
    model = tiny_llama()
    # Distinct tokens: a repeated token has the same pre-RoPE key in layer 0, an exact tie in key-based
    # scores that a one-token and a chunked forward may break differently (rounding, not a policy bug).
    ids = (torch.randperm(93, generator=torch.Generator().manual_seed(4)) + 3).tolist()
    prompt, trace = ids[:37], ids[37:77]
    kw = dict(policy=name, budget=48, buffer=8, seed=1)
    stepwise = replay_logits(model, prompt, trace, chunked=False, **kw)
    chunked = replay_logits(model, prompt, trace, chunked=True, **kw)
    assert stepwise.evictions == chunked.evictions >= 3
    torch.testing.assert_close(chunked.evicting, stepwise.evicting, atol=1e-4, rtol=0)


def test_default_replay_chunks_exactly_the_chunk_exact_policies():
    model = tiny_llama()
    calls, handle = _count_forwards(model)
    replay_logits(model, PROMPT, TRACE, policy="streaming", budget=10, buffer=4)
    chunked_calls = len(calls)
    calls.clear()
    replay_logits(model, PROMPT, TRACE, policy="streaming", budget=10, buffer=4, chunked=False)
    handle.remove()
    assert chunked_calls < len(calls) * 0.6


def test_full_side_equals_a_plain_forward_over_the_whole_sequence():
    model = tiny_llama()
    replay = replay_logits(model, PROMPT, TRACE, policy="streaming", budget=10, buffer=4, max_chunk=7)
    with torch.inference_mode():
        plain = model(input_ids=torch.tensor([PROMPT + TRACE])).logits[0].float()
    want = plain[len(PROMPT) - 1 : len(PROMPT) - 1 + len(TRACE)]
    torch.testing.assert_close(replay.full, want, atol=1e-4, rtol=0)


def test_buffer_zero_evicts_every_step_and_still_matches():
    model = tiny_llama()
    want, evictions = _manual_stepwise(model, PROMPT, TRACE[:20], "streaming", 12, 0, seed=0)
    got = replay_logits(model, PROMPT, TRACE[:20], policy="streaming", budget=12, buffer=0, chunked=True)
    torch.testing.assert_close(got.evicting, want, atol=1e-4, rtol=0)
    assert got.evictions == evictions > 10


def _greedy_trace(model, prompt, n):
    tokenizer = CharTokenizer()
    [out] = reasonkv.generate(model, tokenizer, [prompt], max_new_tokens=n, ignore_eos=True)
    return out.token_ids


def test_full_policy_and_a_budget_beyond_the_sequence_agree_perfectly():
    model = tiny_llama()
    trace = _greedy_trace(model, PROMPT, 30)
    for policy, budget in (("full", None), ("streaming", 500), ("random", 500)):
        [row] = trace_fidelity(model, [PROMPT], [trace], policy=policy, budget=budget, buffer=8)
        assert row.top1_agreement == 1.0, policy
        assert row.top1_full_replay == 1.0
        assert row.kl_mean == pytest.approx(0.0, abs=1e-6)
        assert row.evictions == 0
        assert row.steps == 30


def test_agreement_and_kl_match_the_formulas_on_the_replayed_logits():
    model = tiny_qwen3()
    trace = _greedy_trace(model, PROMPT, 36)
    [row] = trace_fidelity(model, [PROMPT], [trace], policy="streaming", budget=8, buffer=3, seed=[3])
    replay = replay_logits(model, PROMPT, trace, policy="streaming", budget=8, buffer=3, seed=3)
    target = torch.tensor(trace)
    agreement = (replay.evicting.argmax(-1) == target).double().mean().item()
    p = replay.full.double().softmax(-1)
    kl = (p * (p.log() - replay.evicting.double().log_softmax(-1))).sum(-1)
    assert row.top1_agreement == pytest.approx(agreement)
    assert row.kl_mean == pytest.approx(kl.mean().item(), rel=1e-4, abs=1e-7)
    assert row.kl_max == pytest.approx(kl.max().item(), rel=1e-4, abs=1e-7)
    assert row.kl_mean > 0 and row.evictions > 0


def test_batched_rows_give_the_metrics_they_get_alone():
    model = tiny_llama()
    prompts = [PROMPT, _ids(4, 5), _ids(15, 6)]
    traces = [_greedy_trace(model, p, n) for p, n in zip(prompts, (30, 12, 25), strict=True)]
    kwargs = dict(policy="random", budget=9, buffer=3)
    together = trace_fidelity(model, prompts, traces, seed=[1, 2, 3], **kwargs)
    for i in range(3):
        [alone] = trace_fidelity(model, [prompts[i]], [traces[i]], seed=[i + 1], **kwargs)
        assert together[i].evictions == alone.evictions
        assert together[i].steps == alone.steps
        assert together[i].top1_agreement == pytest.approx(alone.top1_agreement)
        assert together[i].kl_mean == pytest.approx(alone.kl_mean, rel=1e-3, abs=1e-6)


def test_answer_logprob_matches_a_plain_forward_and_vanishes_without_eviction():
    model = tiny_llama()
    solution = _ids(30, 9)
    a, b = 24, 28  # the "answer" tokens
    reference = (solution[:b], a, b)
    with torch.inference_mode():
        logp = model(input_ids=torch.tensor([PROMPT + solution[:b]])).logits[0].float().log_softmax(-1)
    want = sum(float(logp[len(PROMPT) - 1 + j, solution[j]]) for j in range(a, b))

    [roomy] = answer_logprob(model, [PROMPT], [reference], policy="streaming", budget=500, buffer=8)
    assert roomy.logprob_full == pytest.approx(want, abs=1e-3)
    assert roomy.logprob_evicting == pytest.approx(want, abs=1e-3)
    assert roomy.delta_sum == pytest.approx(0.0, abs=1e-4)
    assert roomy.answer_tokens == 4 and roomy.reference_tokens == 28

    [tight] = answer_logprob(model, [PROMPT], [reference], policy="streaming", budget=8, buffer=2)
    replay = replay_logits(model, PROMPT, solution[:b], policy="streaming", budget=8, buffer=2)
    evict = replay.evicting.log_softmax(-1)
    want_evict = sum(float(evict[j, solution[j]]) for j in range(a, b))
    assert tight.logprob_evicting == pytest.approx(want_evict, abs=1e-3)
    assert tight.logprob_full == pytest.approx(want, abs=1e-3)
    assert tight.delta_sum == pytest.approx(want_evict - want, abs=1e-3)
    assert tight.delta_mean == pytest.approx((want_evict - want) / 4, abs=1e-3)
    assert tight.evictions > 0


@pytest.mark.parametrize(
    ("solution", "answer", "expected"),
    [
        ("She has 16 - 3 = 13 left.\n#### 13", "13", "13"),
        ("So $x = \\boxed{\\frac{1}{2}}$ and that is \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.", "", None),
        ("Thus $180 + 24 = 204$. -sepehr2010", "204", "204"),
        ("Then 1204 and 204.5 but finally 204 is it", "204", "204"),
        ("no answer here", "42", None),
    ],
)
def test_answer_span(solution, answer, expected):
    span = answer_span(solution, answer)
    if expected is None and "boxed" in solution:
        assert solution[span[0] : span[1]] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    elif expected is None:
        assert span is None
    else:
        assert solution[span[0] : span[1]] == expected
        if answer == "204" and "finally" in solution:
            assert span[0] == solution.rindex(" 204 ") + 1


def _word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = ["Janet", "has", "16", "eggs", ".", "The", "answer", "is", "\\boxed{13}", "[UNK]"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_reference_continuation_with_character_tokens():
    problem = Problem(
        id="g1", problem="?", answer="13", source="t", solution="Janet has 16 - 3 = <<16-3=13>>13 eggs.\n#### 13"
    )
    tokenizer = CharTokenizer()
    ids, a, b = reference_continuation(tokenizer, problem)
    # the calculator note is dropped, the text is fed as is
    assert ids == tokenizer("Janet has 16 - 3 = 13 eggs.\n#### 13")["input_ids"]
    assert tokenizer.decode(ids[a:b]) == "13"
    assert b == len(ids)
    assert tokenizer.decode(ids[:a]).endswith("#### ")


def test_reference_continuation_with_offsets_and_boxed_answer():
    tokenizer = _word_tokenizer()
    problem = Problem(
        id="m1", problem="?", answer="13", source="t", solution="Janet has 16 eggs . The answer is \\boxed{13} ."
    )
    ids, a, b = reference_continuation(tokenizer, problem)
    # "\boxed{13}" is one word-level token: the answer span is the token that covers it
    assert tokenizer.convert_ids_to_tokens(ids[a:b]) == ["\\boxed{13}"]
    assert b == len(ids)
    assert reference_continuation(tokenizer, Problem(id="x", problem="?", answer="1", source="t")) is None


def test_kl_is_never_negative_and_nan_free_for_one_hot_full_distributions():
    from reasonkv.eval.fidelity import _kl

    full = torch.tensor([[0.0, -math.inf, -math.inf], [-0.1, -2.4, -5.0]])
    evicting = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -2.4, -5.0]])
    kl = _kl(full, evicting)
    assert torch.isfinite(kl).all()
    assert kl[0].item() == pytest.approx(1.0)
    assert kl[1].item() == pytest.approx(0.0)
