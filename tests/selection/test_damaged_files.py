"""Damaged gate and query centers files: the message says what the file is and what was expected, and never
advises loading it without ``weights_only`` (which would run whatever code a pickle holds)."""

from __future__ import annotations

import pickle

import pytest
import torch

from reasonkv.policies.query_centers import QueryCenters
from reasonkv.policies.seer import GateFile, GateShape, SeerGate, load_gate, save_gate


def _gate(path):
    save_gate(GateFile(SeerGate(GateShape(2, 4, 2, 16, 8, 16, 10000.0)), "tiny"), path)


def _centers(path):
    QueryCenters(torch.zeros(2, 4, 8, dtype=torch.complex64), torch.ones(2, 4, 8), (0, 1), 2, 4, 16).save(path)


class _Anything:  # a pickled object of a class: the weights-only reader refuses it
    pass


def _damage(kind, path, write_good):
    if kind == "truncated":
        write_good(path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "text":
        path.write_text("mine\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "object pickle":
        path.write_bytes(pickle.dumps(_Anything(), protocol=2))
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    return path.stat().st_size


EXPECTED = {
    "truncated": "a torch file of {size} bytes that could not be read: truncated or damaged",
    "text": "a text file of {size} bytes, not a torch file",
    "empty": "an empty file",
    "object pickle": "a pickle of {size} bytes that the weights-only reader refused",
    "binary": "{size} bytes that are not a torch file (they start with b'\\x00\\x01",
}
LOADERS = {
    "gate": (load_gate, _gate, "is not a reasonkv gate file", "expected the output of reasonkv calibrate --gates"),
    "centers": (
        QueryCenters.load,
        _centers,
        "is not a reasonkv query centers file",
        "expected the output of reasonkv calibrate --centers",
    ),
}


@pytest.mark.parametrize("which", sorted(LOADERS))
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_a_damaged_file_is_described_and_never_loaded_unsafely(tmp_path, which, kind):
    load, write_good, refusal, expected = LOADERS[which]
    path = tmp_path / "file.pt"
    size = _damage(kind, path, write_good)
    with pytest.raises(ValueError) as caught:
        load(path)
    message = str(caught.value)
    assert refusal in message and expected in message
    assert EXPECTED[kind].format(size=size) in message
    assert "weights_only" not in message and "Errno" not in message and "Invalid argument" not in message


def test_a_file_of_the_other_kind_is_named_by_its_format(tmp_path):
    _centers(tmp_path / "centers.pt")
    with pytest.raises(ValueError, match="a torch file of format 'reasonkv-query-centers'"):
        load_gate(tmp_path / "centers.pt")
    _gate(tmp_path / "gates.pt")
    with pytest.raises(ValueError, match="a torch file of format 'reasonkv-seer-gate'"):
        QueryCenters.load(tmp_path / "gates.pt")
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="a torch file holding a list"):
        load_gate(tmp_path / "list.pt")
