from __future__ import annotations

import pytest

from reasonkv.eval.extraction import extract_answer, find_answer, find_boxed


@pytest.mark.parametrize(
    ("text", "answer", "method"),
    [
        ("so $\\boxed{\\frac{14}{3}}$.", "\\frac{14}{3}", "boxed"),
        ("\\boxed{1} then corrected: \\boxed{2}", "2", "boxed"),
        ("nested \\boxed{\\left\\{ 1, \\frac{2}{3} \\right\\}} done", "\\left\\{ 1, \\frac{2}{3} \\right\\}", "boxed"),
        ("escaped \\boxed{\\{1,2\\}}", "\\{1,2\\}", "boxed"),
        ("\\fbox{7}", "7", "boxed"),
        ("$\\framebox{204}$ minutes", "204", "boxed"),
        ("answer \\boxed 42.", "42", "boxed"),
        ("put it in \\boxed{} like this: \\boxed{5}", "5", "boxed"),
        ("the instruction \\boxed{} alone, final answer is 9", "9", "answer_is"),
        ("Thus the final answer is $\\frac{1}{2}$. Done", "\\frac{1}{2}", "answer_is"),
        ("The final answer is: 12 apples.\nBye", "12 apples", "answer_is"),
        ("Final Answer: $x = 3$", "x = 3", "answer_is"),
        ("so the answer is 3.5.", "3.5", "answer_is"),
        ("**Answer:** 17", "17", "answer_colon"),
        ("Answer: \\(2\\sqrt{3}\\)", "2\\sqrt{3}", "answer_colon"),
        ("She pays 3 * 4 = 12 dollars, then 1,450,000 total.", "1450000", "last_number"),
        ("#### 18", "18", "last_number"),
        ("it is 10-5", "5", "last_number"),
        ("drops to -7 degrees", "-7", "last_number"),
        ("no numbers at all", None, "none"),
        ("cut off \\boxed{\\frac{1}{2", "2", "last_number"),  # an unclosed box is ignored
    ],
)
def test_math_extraction_order(text, answer, method):
    assert find_answer(text, "math") == (answer, method)


def test_last_number_can_be_disabled():
    assert extract_answer("it is 42", "math", last_number=False) is None
    assert extract_answer("it is 42", "math") == "42"


@pytest.mark.parametrize(
    ("text", "letter", "method"),
    [
        ("\\boxed{B}", "B", "boxed"),
        ("\\boxed{\\text{(C)}}", "C", "boxed"),
        ("$\\boxed{D) 10^{-8} eV}$", "D", "boxed"),
        ("\\boxed{A} wait, no: \\boxed{C}", "C", "boxed"),
        ("\\boxed{4.5 eV} so the answer is (C)", "C", "answer_is"),
        ("The correct answer is **B**.", "B", "answer_is"),
        ("Answer: C", "C", "answer_colon"),
        ("Answer: Because of symmetry", None, "none"),
        ("the answer is a subtle one", None, "none"),
        ("I like option B", None, "none"),
    ],
)
def test_choice_extraction(text, letter, method):
    assert find_answer(text, "choice") == (letter, method)


def test_find_boxed_all():
    assert find_boxed("\\boxed{1} and \\boxed{} and \\fbox{x^{2}}") == ["1", "x^{2}"]
    assert find_boxed("\\boxedfoo{1}") == []


def test_bad_kind():
    with pytest.raises(ValueError):
        find_answer("x", "essay")
