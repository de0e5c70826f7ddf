"""The query window: the last w queries across forwards of any length, without holding a long prefill."""

from __future__ import annotations

import torch

from reasonkv.policies.recorded import QueryWindow


def _forward(start: int, n: int, batch: int = 2, heads: int = 3, dim: int = 4):
    queries = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(batch, heads, n, dim)
    positions = torch.arange(start, start + n).expand(batch, n)
    return queries.contiguous(), positions.contiguous(), torch.ones(batch, n, dtype=torch.bool)


def test_window_holds_the_last_w_queries_oldest_first_across_prefill_and_steps():
    window = QueryWindow(4)
    window.push(*_forward(0, 2))
    queries, positions, valid = window.tensors()
    assert positions[0].tolist() == [-1, -1, 0, 1] and valid[0].tolist() == [False, False, True, True]
    assert queries[:, :, :2].eq(0).all() and queries[0, 0, 2:, 0].tolist() == [0.0, 1.0]
    window.push(*_forward(2, 9))
    for step in range(11, 14):
        window.push(*_forward(step, 1))
        queries, positions, valid = window.tensors()
        assert positions[1].tolist() == list(range(step - 3, step + 1)) and valid.all()
        assert queries[1, 2, :, 3].tolist() == [float(p) for p in range(step - 3, step + 1)]


def test_window_keeps_a_copy_of_a_long_prefills_tail_not_a_view_of_all_its_queries():
    window = QueryWindow(4)
    queries, positions, valid = _forward(0, 1000)
    window.push(queries, positions, valid)
    kept = window._entries[0]
    for tensor, whole in ((kept.queries, queries), (kept.positions, positions), (kept.valid, valid)):
        assert tensor.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
