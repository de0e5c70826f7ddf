"""Shared policy building blocks."""

from __future__ import annotations

import torch

from reasonkv.policies.common import PositionTable, group_mean, pool1d


def test_position_table_set_get_add_and_padding():
    table = PositionTable(2, fill=-1.0)
    table.set(torch.tensor([[0, 1, 2], [-1, 0, 1]]), torch.tensor([[1.0, 2.0, 3.0], [9.0, 4.0, 5.0]]))
    assert table.get(torch.tensor([[2, 0], [1, -1]])).tolist() == [[3.0, 1.0], [5.0, -1.0]]
    table.add(torch.tensor([[1, 1], [0, -1]]), torch.tensor([[1.0, 1.0], [1.0, 7.0]]))
    assert table.get(torch.tensor([[1], [0]])).tolist() == [[4.0], [5.0]]
    table.set(torch.tensor([[500], [0]]), torch.tensor([[8.0], [5.0]]))  # grows
    assert table.get(torch.tensor([[500, 499]])[:, :].expand(2, -1)).tolist()[0] == [8.0, -1.0]


def test_position_table_with_inner_dims():
    table = PositionTable(1, (2,))
    table.add(torch.tensor([[3, 4]]), torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]))
    assert table.get(torch.tensor([[4, 3]])).tolist() == [[[2.0, 1.0], [4.0, 3.0]]]
    assert table.get(torch.tensor([[[4], [3]]])).tolist() == [[[2.0], [3.0]]]


def test_group_mean_follows_repeat_kv_order():
    scores = torch.arange(8.0).view(1, 4, 2)  # 4 query heads, 2 kv heads
    assert group_mean(scores, 2).tolist() == [[[1.0, 2.0], [5.0, 6.0]]]


def test_pool1d_keeps_length():
    x = torch.tensor([[0.0, 5.0, 0.0, 0.0, 1.0]])
    assert pool1d(x, 3, "max").tolist() == [[5.0, 5.0, 5.0, 1.0, 1.0]]
    assert pool1d(x, 3, "avg").shape == x.shape
    assert torch.equal(pool1d(x, 1), x)


def test_position_table_set_never_writes_padding_over_a_real_position():
    table = PositionTable(1, fill=-1.0)
    # padding (-1) and position 0 in the same call: position 0 must get its own value
    for _ in range(20):
        table.set(torch.tensor([[-1, -1, 0, 1]]), torch.tensor([[7.0, 8.0, 1.0, 2.0]]))
        assert table.get(torch.tensor([[0, 1]])).tolist() == [[1.0, 2.0]]


def test_position_table_lookup_selects_rows_and_inner_index():
    table = PositionTable(2, (2, 3))
    table.add(torch.tensor([[0, 1], [0, 1]]), torch.arange(24.0).view(2, 2, 3, 2))
    positions = torch.tensor([[[1, -1], [0, 1], [1, 1]]])
    got = table.lookup(torch.tensor([1]), positions, 1)
    assert got.tolist() == [[[19.0, 0.0], [20.0, 21.0], [23.0, 23.0]]]
