"""vLLM's scheduler with requests sized by the tokens they hold (:mod:`.physical`), not the tokens they computed.

A request first gives back the blocks past what it holds after its last eviction (the worker compacted it into
its first blocks), then gets blocks for what it holds plus the new tokens, so admission and preemption see the
physical sizes (docs/vllm.md). Per-request statistics go to the log and, with ``stats_file``, one JSON line each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request, RequestStatus

from reasonkv.integrations.vllm.config import Settings, settings_of
from reasonkv.integrations.vllm.physical import Lengths

__all__ = ["EvictingScheduler", "PhysicalSizing"]

logger = init_logger(__name__)


@dataclass
class _Held:
    start: int  # the tokens the request had when its computation (re)started: its prompt, or all after a preemption
    peak_blocks: int = 0
    peak_blocks_evicted: int = 0  # after the first eviction
    earlier_evictions: int = 0  # before its last preemption
    restarts: list[int] = field(default_factory=list)  # the tokens it had at each resumption


@dataclass
class PhysicalSizing:
    """Replaces one ``KVCacheManager``'s ``allocate_slots``: the blocks a request needs for what it holds."""

    manager: KVCacheManager
    lengths: Lengths
    block_size: int
    held: dict[str, _Held] = field(default_factory=dict)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        if num_new_computed_tokens or num_external_computed_tokens or num_lookahead_tokens or num_encoder_tokens:
            raise RuntimeError(
                "reasonkv: a prefix-cache hit, external KV, lookahead or encoder tokens reached the evicting scheduler"
            )
        manager, size = self.manager, self.block_size
        group = manager.coordinator.single_type_managers[0]
        blocks = group.req_to_blocks[request.request_id]
        computed = request.num_computed_tokens
        held = self.held.get(request.request_id)
        if held is None:
            held = self.held[request.request_id] = _Held(request.num_prompt_tokens)
        elif computed == 0:  # resumed after a preemption: prompt and output so far are computed again, then evicted
            held.start = request.num_tokens
            held.restarts.append(request.num_tokens)
        prompt = held.start
        holds = self.lengths.physical(computed, prompt)
        keep = self.lengths.blocks(holds, size)
        if len(blocks) > keep:  # the worker compacted this request into its first `keep` blocks
            freed = blocks[keep:]
            del blocks[keep:]
            manager.block_pool.free_blocks(reversed(freed))
        needed = holds + num_new_tokens
        free = manager.block_pool.get_num_free_blocks() - reserved_blocks
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            free -= manager.watermark_blocks
        if full_sequence_must_fit and self.lengths.blocks(max(needed, request.num_tokens), size) - len(blocks) > free:
            return None
        if self.lengths.blocks(needed, size) - len(blocks) > free:
            return None
        new_blocks = group.allocate_new_blocks(request.request_id, needed, needed)
        count = len(blocks)
        held.peak_blocks = max(held.peak_blocks, count)
        if self.lengths.evictions(computed, prompt):
            held.peak_blocks_evicted = max(held.peak_blocks_evicted, count)
        return manager.create_kv_cache_blocks((new_blocks,))

    def evictions(self, request: Request, held: _Held) -> int:
        return held.earlier_evictions + self.lengths.evictions(request.num_computed_tokens, held.start)

    def preempted(self, request: Request) -> None:
        """Before vLLM frees a preempted request's blocks: count the evictions its computation made."""
        held = self.held.get(request.request_id)
        if held is not None:
            held.earlier_evictions = self.evictions(request, held)

    def finished(self, request: Request) -> dict:
        """The request's statistics, forgotten here."""
        held = self.held.pop(request.request_id, None) or _Held(request.num_prompt_tokens)
        return {
            "request_id": request.request_id,
            "prompt_tokens": request.num_prompt_tokens,
            "computed_tokens": request.num_computed_tokens,
            "evictions": self.evictions(request, held),
            "peak_blocks": held.peak_blocks,
            "peak_blocks_after_first_eviction": held.peak_blocks_evicted,
            "resumed_at": held.restarts,
            "block_size": self.block_size,
        }


class EvictingScheduler(Scheduler):
    """The V1 scheduler, sizing requests physically (:class:`PhysicalSizing`). A request resumed after a preemption
    takes its prompt and decoded tokens as its prompt from then on, as the worker does (docs/vllm.md)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        settings = settings_of(vllm_config)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            raise ValueError("reasonkv: the model's KV cache has more than one kind of layer; full attention only")
        self.reasonkv: Settings = settings
        block_size = groups[0].kv_cache_spec.block_size
        self.reasonkv_sizing = PhysicalSizing(self.kv_cache_manager, settings.lengths, block_size)
        self.kv_cache_manager.allocate_slots = self.reasonkv_sizing.allocate_slots
        logger.info(
            "reasonkv: %s, K=%d, B=%d, block size %d",
            settings.spec.policy.config(),
            settings.spec.budget,
            settings.spec.buffer,
            block_size,
        )

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        self.reasonkv_sizing.preempted(request)
        super()._preempt_request(request, timestamp, drop_stale_output)

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        stats = self.reasonkv_sizing.finished(request)
        logger.info("reasonkv: %s", json.dumps(stats))
        if self.reasonkv.stats_file:
            with open(self.reasonkv.stats_file, "a", encoding="utf-8") as out:
                out.write(json.dumps(stats) + "\n")
        return super()._free_request(request, delay_free_blocks)
