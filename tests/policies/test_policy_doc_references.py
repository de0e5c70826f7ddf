"""What a policy's docstring (its option help, `reasonkv policies`) points a reader to exists in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import reasonkv
from reasonkv.policies.option_docs import option_meanings
from reasonkv.policies.registry import policy_class

ROOT = Path(__file__).resolve().parents[2]
NAMES = reasonkv.list_policies()


def _documents(name: str) -> str:
    cls = policy_class(name)
    return "\n".join(klass.__doc__ or "" for klass in cls.__mro__ if issubclass(klass, reasonkv.Policy))


@pytest.mark.parametrize("name", NAMES)
def test_the_files_a_policy_doc_cites_are_in_the_repository(name):
    text = _documents(name)
    cited = set(re.findall(r"\b((?:docs|src|tests|scripts)/[\w./-]*\w)", text))
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, f"{name}'s docstring cites {missing}, not in the repository"
    # The method specification the first policies were written from is not part of the repository.
    assert not re.search(r"\bMETHODS\b", text), f"{name}'s docstring cites METHODS, not in the repository"


def test_option_help_cites_no_missing_document():
    for name in NAMES:
        for option, meaning in option_meanings(policy_class(name)).items():
            assert "METHODS" not in meaning, (name, option, meaning)
