"""Host synchronisation under an allocation: once every row has been evicted, a decode step between evictions
forces no more host reads than a plain transformers step (the rows' due counts are bounded on the host). A row
still before its first eviction grows its ragged regions with a host read now and then (rows of equal length
here, so that they evict together)."""

from __future__ import annotations

import pytest

from conftest import tiny_llama
from test_syncs import PROMPTS, _plain_step_syncs, _steps


@pytest.mark.parametrize("allocation", ["pyramid", "adaptive"])
def test_a_step_between_evictions_syncs_no_more_than_plain_transformers(allocation, one_torch_thread):
    model = tiny_llama(layers=3)
    plain = _plain_step_syncs(model)
    counts, evicted = _steps(model, "h2o", batch_prompts=[PROMPTS[0]] * 3, steps=60, allocation=allocation)
    assert sum(evicted) >= 3
    # After the first eviction (before it, the regions grow with the prompt's tokens).
    first = evicted.index(True)
    quiet = [ops for ops, e in zip(counts[first + 1 :], evicted[first + 1 :], strict=True) if not e]
    assert quiet and max(len(ops) for ops in quiet) <= plain, (plain, [ops for ops in quiet if len(ops) > plain][:1])
