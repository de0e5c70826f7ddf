"""What the recorder keeps alive between forward passes: after a long prefill every attention reader holds
only the queries it will read (the newest of each forward, its window), not the prefill's query tensors."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import tiny_llama
from reasonkv.hf import cache_keyword, model_info
from reasonkv.policies import get_policy, list_policies

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 6, 4, 2, 16
PROMPT_LENGTHS = (300, 260, 285)  # ragged: padded to 300, all within K + B (no eviction flushes the log)

_INFO = model_info(tiny_llama(kv_heads=KV_HEADS, heads=HEADS, layers=LAYERS))
READERS = [name for name in list_policies() if get_policy(name).needs(_INFO).taps_attention]


def _held_tensors(recorded) -> list[torch.Tensor]:
    log = recorded.log
    held = [*log.positions, *log.valid, *(q for parts in log.queries.values() for q in parts)]
    for window in recorded.windows.values():
        held += [t for entry in window._entries for t in (entry.queries, entry.positions, entry.valid)]
    return held


def _live_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages the tensors keep alive (each storage once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("policy", READERS)
def test_after_a_long_prefill_the_recorder_holds_only_what_it_will_read(policy, one_torch_thread):
    assert {"h2o", "tova", "raas", "thinkv", "snapkv", "vase-attnv", "rkv"} <= set(READERS)
    model = tiny_llama(kv_heads=KV_HEADS, heads=HEADS, layers=LAYERS)
    width = max(PROMPT_LENGTHS)
    ids = torch.tensor([[0] * (width - n) + [5 + (7 * i) % 80 for i in range(n)] for n in PROMPT_LENGTHS])
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in PROMPT_LENGTHS])
    cache = reasonkv.EvictingCache(320, 16, model=model, policy=policy)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): cache})
    held = _held_tensors(cache.evictor.observer.recorded)  # before detach, which hands the owed attention over
    cache.detach()
    assert cache.evictions == 0
    # Policies that read recent queries or the last query's attention log the newest query; H2O takes a
    # prefill's column sums at once and TriAttention each forward's queries as they come: neither logs.
    needs = cache.evictor.needs
    assert bool(held) == bool(needs.query_window or needs.attention_last), policy
    # The queries a policy reads: the newest of the prefill, and its window of recent ones, per layer.
    window = cache.evictor.needs.query_window
    batch = len(PROMPT_LENGTHS)
    wanted = LAYERS * batch * HEADS * HEAD_DIM * 4 * (window + 1)
    bookkeeping = (LAYERS + 1) * batch * (window + 1) * (8 + 1)  # positions (int64) and validity (bool)
    prefill_queries = LAYERS * batch * HEADS * width * HEAD_DIM * 4
    live = _live_bytes(held)
    assert live <= wanted + bookkeeping, (live, wanted, prefill_queries)
    # Each tensor held owns its storage: none is a view into a larger tensor of the prefill.
    for tensor in held:
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
