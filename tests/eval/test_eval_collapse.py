from __future__ import annotations

import numpy as np
import pytest

from reasonkv.eval.collapse import FLAGS, collapse_flags, stopped_early, tail_loop

rng = np.random.default_rng(0)
PROSE = rng.integers(100, 30000, size=400).tolist()  # stands in for ordinary text: no loop at the end
PHRASE = [11, 12, 13, 14, 15, 16, 17]


def _flags(ids, text="We get \\boxed{3}.", *, max_new_tokens=4096, eos_hit=True, **kw):
    return collapse_flags(text, ids, max_new_tokens=max_new_tokens, eos_hit=eos_hit, **kw)


def test_seven_token_loop_repeated_ten_times():
    ids = PROSE + PHRASE * 10
    assert tail_loop(ids) == (7, 10.0)
    flags = _flags(ids, max_new_tokens=len(ids), eos_hit=False)
    assert flags["repetition"] and flags["max_tokens"] and flags["collapsed"]
    assert set(flags) == set(FLAGS)


def test_loop_cut_mid_phrase_still_counts():
    ids = PROSE + PHRASE * 10 + PHRASE[:3]
    period, repeats = tail_loop(ids)
    assert period == 7 and repeats == pytest.approx(10 + 3 / 7)
    assert _flags(ids)["repetition"]


def test_ordinary_text_is_not_a_loop():
    flags = _flags(PROSE)
    assert flags == {
        "empty": False,
        "no_answer": False,
        "repetition": False,
        "max_tokens": False,
        "collapsed": False,
        "early_stop": False,
    }


@pytest.mark.parametrize(
    "tail",
    [
        PHRASE * 3,  # a phrase said three times
        PHRASE * 9,  # 63 tokens: just under the span floor
        [5] * 20,  # a short run of one token ("====")
        list(range(200, 264)) * 2,  # a 64-token paragraph said twice
    ],
)
def test_short_loops_below_threshold(tail):
    assert not _flags(PROSE + tail)["repetition"]


@pytest.mark.parametrize("tail", [[5] * 64, [1, 2] * 40, list(range(200, 264)) * 4])
def test_loops_at_threshold(tail):
    assert _flags(PROSE + tail)["repetition"]


def test_loop_in_the_middle_does_not_count():
    assert not _flags(PHRASE * 20 + PROSE)["repetition"]


def test_thresholds_are_options():
    ids = PROSE + PHRASE * 5
    assert not _flags(ids)["repetition"]
    assert _flags(ids, min_span=30)["repetition"]
    assert not _flags(PROSE + list(range(300, 380)) * 5, max_period=64)["repetition"]
    assert _flags(PROSE + list(range(300, 380)) * 5, max_period=80)["repetition"]


def test_empty_and_no_answer():
    flags = _flags([], text="  \n", eos_hit=True)
    assert flags["empty"] and flags["no_answer"] and flags["collapsed"]
    assert not flags["early_stop"]  # an empty output is a collapse, counted there only
    # stopped early by EOS without an answer: not collapsed, an early stop
    flags = _flags(PROSE, text="I think it is 42")
    assert flags["no_answer"] and not flags["collapsed"] and flags["early_stop"]
    # ran out of tokens without an answer: collapsed
    flags = _flags(PROSE, text="still thinking about 42", max_new_tokens=len(PROSE), eos_hit=False)
    assert flags["max_tokens"] and flags["no_answer"] and flags["collapsed"] and not flags["early_stop"]
    # ran out of tokens but had answered: not collapsed
    flags = _flags(PROSE, text="Answer: 42", max_new_tokens=len(PROSE), eos_hit=False)
    assert flags["max_tokens"] and not flags["no_answer"] and not flags["collapsed"]


def test_choice_kind_and_numpy_input():
    flags = _flags(np.array(PROSE), text="so \\boxed{C}", kind="choice")
    assert not flags["no_answer"]
    assert _flags(PROSE, text="so \\boxed{4.2}", kind="choice")["no_answer"]


def test_tail_loop_edge_cases():
    assert tail_loop([]) == (0, 0.0)
    assert tail_loop([1]) == (0, 0.0)
    assert tail_loop([1, 2, 3]) == (0, 0.0)
    assert tail_loop([4, 4, 4]) == (1, 3.0)


def test_reference_solutions_are_not_loops():
    from reasonkv.eval.datasets import load_dataset

    vocab: dict[str, int] = {}
    for p in load_dataset("math500", limit=100) + load_dataset("gsm8k", limit=100):
        # word-level ids: real prose with its own repeated words and formulas
        ids = [vocab.setdefault(w, len(vocab)) for w in p.solution.replace("$", " $ ").split()]
        flags = _flags(ids, text=p.solution)
        assert not flags["repetition"] and not flags["collapsed"], p.id


def test_records_written_before_the_early_stop_flag_are_read_from_their_other_flags():
    old = {"empty": False, "no_answer": True, "repetition": False, "max_tokens": False, "collapsed": False}
    assert stopped_early(old)
    assert not stopped_early({**old, "max_tokens": True, "collapsed": True})
    assert not stopped_early({**old, "no_answer": False}) and not stopped_early(None)
