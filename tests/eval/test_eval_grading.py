from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import reasonkv.eval
from reasonkv.eval import _symbolic
from reasonkv.eval.datasets import Problem, load_dataset
from reasonkv.eval.grading import Grade, counts_as_correct, cut_off_guess, grade, is_equivalent, normalize_answer


def _by_id(name: str) -> dict[str, Problem]:
    return {p.id: p for p in load_dataset(name)}


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("\\dfrac{14}{3}", "\\frac{14}{3}"),
        ("14/3", "\\frac{14}{3}"),
        ("\\tfrac{14}{3}", "14/3"),
        ("\\sqrt{117}", "3\\sqrt{13}"),
        ("\\frac{\\sqrt{570}}{12}", "\\sqrt{\\frac{95}{24}}"),
        ("(3,4]", "(3, 4]"),
        ("(-\\infty,0]", "(-\\infty, 0]"),
        ("(3,\\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\frac{\\pi-2}{\\pi}", "1-\\frac{2}{\\pi}"),
        ("Evelyn", "\\text{Evelyn}"),
        ("C", "\\text{(C)}"),
        ("5.4", "5.4 \\text{ cents}"),
        ("864", "864 \\mbox{ inches}^2"),
        ("15 \\text{ cm}^2", "15\\mbox{ cm}^2"),
        ("90", "90^\\circ"),
        ("90^{\\circ}", "90^\\circ"),
        ("\\frac{270}{7}", "\\frac{270}7\\text{ degrees}"),
        ("50\\%", "50"),
        ("-\\frac{35}{9}", "-3\\frac{8}{9}"),
        ("1,450,000", "1450000"),
        ("10080", "10,\\!080"),
        ("32348", "\\$32,\\!348"),
        ("18.9", "\\$18.90"),
        ("0.15", "\\frac{3}{20}"),
        (".0000672", "6.72\\times 10^{-5}"),
        ("025", "25"),
        ("x = 5", "5"),
        ("[-2,7]", "x \\in [-2,7]"),
        ("-2, 1", "1,-2"),
        ("\\{1,-2\\}", "1,-2"),
        ("1+\\sqrt{5}, -2, 1-\\sqrt{5}", "\\{1\\pm\\sqrt{5},-2\\}"),
        ("26! \\cdot 2^{25}", "2^{25} \\cdot 26!"),
        ("\\frac{\\cos x}{\\sin x}", "\\cot x"),
        ("6-5i", "6 - 5i"),
        ("\\begin{pmatrix}-1/3\\\\2/3\\\\5/3\\end{pmatrix}", "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}"),
        ("1,-16,-4,43", "(1,-16,-4,43)"),
        ("(0,9)\\cup(9,36)", "(0,9) \\cup (9,36)"),
    ],
)
def test_equivalent(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("4.67", "\\frac{14}{3}"),
        ("\\sqrt{13}", "3\\sqrt{13}"),
        ("(3, 4)", "(3,4]"),
        ("(3,\\pi)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\text{Bob}", "\\text{Evelyn}"),
        ("nevelyE", "\\text{Evelyn}"),  # an anagram: equal as a product of symbols, not as a name
        ("odd", "\\text{even}"),
        ("(B)", "\\text{(C)}"),
        ("\\frac{35}{9}", "-\\frac{35}{9}"),
        ("1,450,001", "1450000"),
        ("24", "25"),
        ("2^{24} \\cdot 26!", "2^{25} \\cdot 26!"),
        ("1", "1,-2"),
        ("1, 1", "1,-2"),
        ("42", "52_8"),
        ("6+5i", "6 - 5i"),
        ("q-p", "p - q"),
        ("(1,-16,-4,42)", "(1,-16,-4,43)"),
        ("", "1"),
        (None, "1"),
    ],
)
def test_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


def test_math500_cases_from_file():
    answers = {p.answer: p for p in load_dataset("math500")}
    for gold, good, bad in [
        ("\\frac{14}{3}", ["\\dfrac{14}{3}", "14/3", "4\\frac{2}{3}"], ["14/4", "4.6"]),
        ("\\text{Evelyn}", ["Evelyn", "\\textbf{Evelyn}"], ["Bob"]),
        # the problem asks for degrees; an answer in radians is graded as written
        ("90^\\circ", ["90", "90^{\\circ}", "90 \\text{ degrees}"], ["45", "\\frac{\\pi}{2}"]),
        ("3\\sqrt{13}", ["\\sqrt{117}"], ["3\\sqrt{12}"]),
        ("(3,4]", ["(3, 4]"], ["[3,4]"]),
        ("11,\\! 111,\\! 111,\\! 100", ["11111111100", "11,111,111,100"], ["11111111000"]),
        ("1 \\pm \\sqrt{19}", ["1-\\sqrt{19}, 1+\\sqrt{19}"], ["1+\\sqrt{19}"]),
    ]:
        problem = answers[gold]
        for text in good:
            g = grade(f"... so the result is $\\boxed{{{text}}}$.", problem)
            assert g.correct, (gold, text)
        for text in bad:
            assert not grade(f"\\boxed{{{text}}}", problem).correct, (gold, text)


def test_hmmt_cases_from_file():
    hmmt = _by_id("hmmt25")
    assert grade("\\boxed{\\frac{1311}{2017}}", hmmt["hmmt-feb-2025-6"]).correct
    assert not grade("\\boxed{\\frac{1311}{2016}}", hmmt["hmmt-feb-2025-6"]).correct
    assert grade("\\boxed{2^{25} \\cdot 26!}", hmmt["hmmt-feb-2025-17"]).correct
    assert grade("\\boxed{26!\\, 2^{25}}", hmmt["hmmt-feb-2025-17"]).correct
    assert not grade("\\boxed{2^{26} \\cdot 25!}", hmmt["hmmt-feb-2025-17"]).correct
    assert grade("\\boxed{\\frac{1}{576}}", hmmt["hmmt-feb-2025-3"]).correct
    assert grade("\\boxed{\\frac{9}{\\sqrt{23}}}", hmmt["hmmt-feb-2025-7"]).correct
    assert grade("\\boxed{-984}", hmmt["hmmt-feb-2025-4"]).correct
    assert not grade("\\boxed{984}", hmmt["hmmt-feb-2025-4"]).correct
    two = hmmt["hmmt-feb-2025-10"]
    assert grade("\\boxed{\\frac{-1+\\sqrt{17}}{2}, \\frac{-1-\\sqrt{17}}{2}}", two).correct
    assert grade("\\boxed{\\frac{-1-\\sqrt{17}}{2}, \\frac{-1+\\sqrt{17}}{2}}", two).correct
    assert grade("\\boxed{\\frac{-1\\pm\\sqrt{17}}{2}}", two).correct
    assert grade("\\boxed{\\left\\{\\frac{-1-\\sqrt{17}}{2}, \\frac{-1+\\sqrt{17}}{2}\\right\\}}", two).correct
    assert not grade("\\boxed{\\frac{-1+\\sqrt{17}}{2}}", two).correct
    both = "So $a = \\boxed{\\frac{-1-\\sqrt{17}}{2}}$ or $a = \\boxed{\\frac{-1+\\sqrt{17}}{2}}$."
    assert grade(both, two) == Grade("\\frac{-1-\\sqrt{17}}{2}, \\frac{-1+\\sqrt{17}}{2}", True, "boxed")
    assert not grade("\\boxed{\\frac{-1+\\sqrt{17}}{2}} or \\boxed{3}", two).correct
    assert not grade("\\boxed{\\frac{-1+\\sqrt{17}}{2}, \\frac{1-\\sqrt{17}}{2}}", two).correct


def test_aime_and_gsm8k_cases_from_file():
    aime = _by_id("aime24")["aime2024-I-2"]
    assert aime.extra["answer_raw"] == "025"
    assert grade("\\boxed{025}", aime).correct and grade("\\boxed{25}", aime).correct
    assert not grade("\\boxed{250}", aime).correct
    gsm = next(p for p in load_dataset("gsm8k") if p.extra["answer_raw"] == "1,450,000")
    assert gsm.answer == "1450000"
    assert grade("He makes $1,450,000 in total.", gsm) == Grade("1450000", True, "last_number")
    assert grade("\\boxed{\\$1,450,000}", gsm).correct
    assert not grade("\\boxed{1,450}", gsm).correct


def test_gpqa_letters_from_file():
    for p in load_dataset("gpqa", limit=20):
        wrong = next(c for c in "ABCD" if c != p.answer)
        assert grade(f"</think>The answer is \\boxed{{{p.answer}}}", p).correct
        assert grade(f"Answer: ({p.answer})", p).correct
        assert not grade(f"\\boxed{{{wrong}}}", p).correct
        assert grade(f"\\boxed{{{p.answer}}} hmm</think> none", p) == Grade(p.answer, True, "boxed", True)


def test_boxed_in_thinking_then_final_answer():
    problem = Problem(id="t", problem="?", answer="\\frac{1311}{2017}", source="t")
    text = "<think>maybe \\boxed{\\frac{1}{2}}? no.</think>\nSo the answer is $\\boxed{\\frac{1311}{2017}}$."
    assert grade(text, problem) == Grade("\\frac{1311}{2017}", True, "boxed")
    flipped = "<think>maybe \\boxed{\\frac{1311}{2017}}? no.</think>\nFinal answer: $\\frac{1}{2}$"
    assert grade(flipped, problem) == Grade("\\frac{1}{2}", False, "answer_is")


def test_last_number_only_for_numeric_gold():
    latex = Problem(id="l", problem="?", answer="\\frac{1}{2}", source="t")
    assert grade("it comes to 1 over 2", latex) == Grade(None, False, "none")
    number = Problem(id="n", problem="?", answer="2", source="t")
    assert grade("it comes to 1 over 2", number) == Grade("2", True, "last_number")


def test_the_last_number_of_an_output_cut_off_at_the_token_limit_is_no_answer():
    problem = Problem(id="gsm8k-test-0001", problem="?", answer="3", source="t")
    cut_off = "Let us list the steps.\n1. First, 2 bolts.\n2. Then half of that.\n3. Now, we need"
    assert grade(cut_off, problem, complete=False) == Grade(None, False, "none")
    assert grade(cut_off, problem) == Grade("3", True, "last_number")  # had it ended there by itself
    boxed = "The answer is \\boxed{3}. Now, we need"
    assert grade(boxed, problem, complete=False) == Grade("3", True, "boxed")  # an answer given before the limit
    record = {"correct": True, "grading_method": "last_number", "finish_reason": "length"}
    assert cut_off_guess(record) and not counts_as_correct(record)  # records graded before the rule
    assert counts_as_correct({**record, "finish_reason": "eos"}) and not counts_as_correct({"correct": "yes"})


def _share_correct(problems) -> tuple[float, list[tuple[str, str, str | None]]]:
    misses = []
    for p in problems:
        g = grade(p.solution, p)
        if not g.correct:
            misses.append((p.id, p.answer, g.extracted))
    return 1 - len(misses) / len(problems), misses


def test_reference_solutions_grade_correct():
    share, misses = _share_correct(load_dataset("math500", limit=50))
    assert share >= 0.95, misses
    share, misses = _share_correct(load_dataset("gsm8k", limit=300))
    assert share >= 0.99, misses
    share, misses = _share_correct(load_dataset("aime24"))
    assert share >= 0.9, misses


def test_normalize_answer():
    assert normalize_answer("$\\dfrac{1}{2}$") == "\\frac{1}{2}"
    assert normalize_answer("1,450,000") == "1450000"
    assert normalize_answer("\\text{(C)}") == "C"
    assert normalize_answer("x = 5") == "5"
    assert normalize_answer("5x - 7y + 11z + 4 = 0") == "5x - 7y + 11z + 4 = 0"


def test_works_from_other_threads():
    problem = Problem(id="h", problem="?", answer="\\sqrt{\\frac{95}{24}}", source="t")
    result = {}
    thread = threading.Thread(target=lambda: result.update(g=grade("\\boxed{\\frac{\\sqrt{570}}{12}}", problem)))
    thread.start()
    thread.join(60)
    assert result["g"].correct
    pairs = [("\\sqrt{12}", "2\\sqrt{3}", True), ("\\sqrt{13}", "2\\sqrt{3}", False)] * 4
    with ThreadPoolExecutor(4) as pool:
        verdicts = list(pool.map(lambda t: is_equivalent(t[0], t[1]), pairs))
    assert verdicts == [t[2] for t in pairs]


@pytest.mark.parametrize("pred", ["10^{10^{10}}", "3^{3^{20}}", "(10^{7})!"])
def test_huge_expressions_are_bounded(pred):
    start = time.monotonic()
    assert not is_equivalent(pred, "\\sqrt{5}", timeout_s=3)
    assert time.monotonic() - start < 10


@pytest.fixture
def fresh_worker():
    _symbolic.shutdown()
    yield
    _symbolic.shutdown()


def test_hung_worker_is_killed(tmp_path, monkeypatch, fresh_worker):
    script = tmp_path / "hang.py"
    script.write_text("import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\ntime.sleep(600)\n")
    monkeypatch.setattr(_symbolic, "_WORKER_SCRIPT", script)
    start = time.monotonic()
    assert _symbolic.symbolic_equal.__wrapped__("x", "y", 1.0) is False
    assert time.monotonic() - start < 5
    assert _symbolic._worker is None  # killed; the next call starts a fresh one
    monkeypatch.undo()
    assert _symbolic.symbolic_equal.__wrapped__("\\sqrt{4}", "2", 10.0) is True


def test_worker_that_cannot_start(tmp_path, monkeypatch, fresh_worker):
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(_symbolic, "_WORKER_SCRIPT", script)
    with pytest.raises(RuntimeError, match="failed to start"):
        _symbolic.symbolic_equal.__wrapped__("x", "y", 1.0)


def test_grading_does_not_need_torch():
    # Load the eval package under a bare stand-in for the top-level package, with torch and
    # transformers made unimportable: nothing in reasonkv.eval may need them at import or grade time.
    package_dir = Path(reasonkv.eval.__file__).resolve().parents[1]
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('reasonkv'); pkg.__path__ = [{str(package_dir)!r}]\n"
        "sys.modules.update(reasonkv=pkg, torch=None, transformers=None)\n"
        "from reasonkv.eval import grade, load_dataset, collapse_flags, build_prompt\n"
        "p = load_dataset('hmmt25', limit=6)[-1]\n"
        "assert grade(r'\\boxed{\\frac{1311}{2017}}', p).correct\n"
        "assert collapse_flags('x', [1, 2], max_new_tokens=10, eos_hit=True)['collapsed'] is False\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
