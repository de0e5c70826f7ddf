"""The length rule the scheduler and the worker share, against reasonkv's own cache counting slots."""

from __future__ import annotations

import pytest
from engines import needs_vllm

needs_vllm()

from reasonkv.cache.rows import RowState  # noqa: E402
from reasonkv.integrations.vllm.physical import Lengths  # noqa: E402


def _held_by_reasonkv(prompt: int, steps: int, budget: int, buffer: int) -> tuple[list[int], list[int]]:
    """What reasonkv's RowState holds after the prefill and after each decode step (evicting to K when due), and
    the evictions it counted by then."""
    import torch

    rows = RowState(budget + buffer)
    held, evictions = [], []
    for q in [prompt] + [1] * steps:
        rows.announce(1, q, None, torch.device("cpu"))
        rows.open_step(q)
        if rows.due_rows() is not None:
            valid = torch.zeros(1, budget, dtype=torch.bool)
            rows.compacted(torch.tensor([0]), valid[:, :0], valid | True)
        held.append(rows.slots)
        evictions.append(int(rows.row_evictions[0]))
    return held, evictions


@pytest.mark.parametrize("budget,buffer", [(64, 16), (8, 0), (5, 3), (32, 32)])
@pytest.mark.parametrize("prompt", [1, 7, 20, 79, 80, 81, 150])
def test_physical_length_is_what_reasonkv_holds(prompt, budget, buffer):
    lengths = Lengths(budget, buffer)
    held, evictions = _held_by_reasonkv(prompt, 120, budget, buffer)
    assert [lengths.physical(prompt + i, prompt) for i in range(121)] == held
    assert [lengths.evictions(prompt + i, prompt) for i in range(121)] == evictions


def test_a_prompt_computed_in_chunks_is_not_evicted_part_way():
    lengths = Lengths(16, 8)
    assert [lengths.physical(n, 100) for n in (10, 50, 99)] == [10, 50, 99]
    assert lengths.physical(100, 100) == 16
    assert not lengths.evicts_after(32, 32, 100) and lengths.evicts_after(64, 36, 100)
