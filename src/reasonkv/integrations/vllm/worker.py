"""vLLM's CPU worker with a runner that keeps positions logical (RoPE) but sequence lengths and slots physical,
and, after each forward, lets the policy evict the requests that reached ``K + B``.

The runner is vLLM's own ``CPUModelRunner`` (the V1 runner, a subclass of the GPU one) with three methods
wrapped: ``_prepare_inputs`` (seq_lens and the slot mapping from the physical lengths of :mod:`.physical`),
``execute_model`` (the eviction after the forward, before any later step can write a freed block) and
``_update_states`` (a finished request's state dropped). An eviction reads the request's blocks densely in the
backend's own layout (:mod:`.paged`), asks the policy which tokens stay (:mod:`.rows`), writes them into the
first blocks in the order they came, and trims the request's block table to the blocks that hold them, exactly
as the scheduler trims its own on the request's next step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from reasonkv.hf import model_info
from reasonkv.integrations.vllm.config import Settings, settings_of
from reasonkv.integrations.vllm.paged import BlockLayout, probe_layout
from reasonkv.integrations.vllm.rows import RequestRow, kept_indices
from reasonkv.policies import noise
from reasonkv.policies.recorded import Recorded

__all__ = ["EvictingCPURunner", "EvictingCPUWorker"]


class EvictingCPUWorker(CPUWorker):
    """vLLM's CPU worker whose model runner evicts (:class:`EvictingCPURunner`)."""

    def init_device(self) -> None:
        super().init_device()
        if type(self.model_runner) is not CPUModelRunner:
            raise ValueError("reasonkv: vLLM's V2 CPU model runner is not supported; the V1 runner is")
        # The runner is built by vLLM's own code (its constructor sets up the CPU's device stand-ins); only its
        # class changes, to a subclass that adds state and wraps three methods.
        self.model_runner.__class__ = EvictingCPURunner
        self.model_runner.reasonkv_setup(settings_of(self.vllm_config))


@dataclass
class _Request:
    """What the worker keeps of an evicting request: the logical positions of the tokens its blocks hold (per
    layer and head, ``[layers, kv_heads, held]``) up to logical length ``logical``, its policy and evictions."""

    policy: object
    recorded: Recorded
    positions: torch.Tensor | None = None
    logical: int = 0
    evictions: int = 0


class EvictingCPURunner(CPUModelRunner):
    """``CPUModelRunner`` whose requests hold at most ``K + B`` tokens once evicting (see the module doc)."""

    def reasonkv_setup(self, settings: Settings) -> None:
        self.reasonkv = settings
        self.reasonkv_info = model_info(self.model_config.hf_config)
        self.reasonkv_requests: dict[str, _Request] = {}
        # The tokens a request had when it resumed after a preemption: its prompt from then on (see physical.py).
        self.reasonkv_starts: dict[str, int] = {}
        self.reasonkv_forward: list[tuple[str, int, int, int]] = []  # (request, computed, new, prompt)
        self.reasonkv_layout: BlockLayout | None = None
        self.reasonkv_window = settings.spec.policy.needs(self.reasonkv_info).query_window
        self.reasonkv_hooks: list | None = None  # on each attention layer, once the model is loaded

    def _request(self, request_id: str) -> _Request:
        state = self.reasonkv_requests.get(request_id)
        if state is None:
            state = _Request(self.reasonkv.spec.new_policy(), Recorded(self.reasonkv_window))
            state.policy.reset(self.reasonkv_info, 1, torch.device("cpu"))
            self.reasonkv_requests[request_id] = state
        return state

    def _hook_queries(self) -> None:
        """A policy that reads recent queries gets each attention layer's post-RoPE queries of every request, as
        the layer receives them (a hook before its forward: eager mode, which the config check requires)."""
        context = self.compilation_config.static_forward_context
        self.reasonkv_hooks = []
        for name in self.kv_cache_config.kv_cache_groups[0].layer_names:
            layer = extract_layer_index(name)
            module = context[name]
            hook = functools.partial(self._capture, layer, module.num_heads, module.head_size)
            self.reasonkv_hooks.append(module.register_forward_pre_hook(hook))

    def _capture(self, layer: int, heads: int, head_dim: int, module, args) -> None:
        query, start = args[0], 0
        scale, softcap = module.impl.scale, getattr(module.impl, "logits_soft_cap", 0)
        for request_id, computed, new, _ in self.reasonkv_forward:
            queries = query[start : start + new].reshape(new, heads, head_dim).transpose(0, 1).unsqueeze(0).clone()
            positions = torch.arange(computed, computed + new).unsqueeze(0)
            valid = torch.ones(1, new, dtype=torch.bool)
            recorded = self._request(request_id).recorded
            recorded.push_queries(layer, queries, positions, valid)
            # The kernel's own scaling and soft-cap, so that the policy's recomputed attention is the model's.
            recorded.scalings[layer] = scale
            if softcap:
                recorded.softcaps[layer] = softcap
            start += new

    # ------------------------------------------------------------------ one step
    def _update_states(self, scheduler_output):
        result = super()._update_states(scheduler_output)
        for request_id in scheduler_output.finished_req_ids:
            self.reasonkv_requests.pop(request_id, None)
            self.reasonkv_starts.pop(request_id, None)
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            if request_id in cached.resumed_req_ids:  # its blocks were freed: it starts again from all its tokens
                self.reasonkv_requests.pop(request_id, None)
                prompt = self.requests[request_id].num_prompt_tokens
                self.reasonkv_starts[request_id] = prompt + cached.num_output_tokens[index]
        return result

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self.reasonkv_window and self.reasonkv_hooks is None:
            self._hook_queries()
        lengths = self.reasonkv.lengths
        batch = self.input_batch
        count = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:count].astype(np.int64)
        starts = self.reasonkv_starts
        prompts = np.array([starts.get(r, self.requests[r].num_prompt_tokens) for r in batch.req_ids], dtype=np.int64)
        held = np.array([lengths.physical(int(c), int(p)) for c, p in zip(computed, prompts, strict=True)])
        self.reasonkv_forward = [
            (r, int(c), int(n), int(p))
            for r, c, n, p in zip(batch.req_ids, computed, num_scheduled_tokens[:count], prompts, strict=True)
        ]
        shift = computed - held  # logical minus physical: the tokens evicted so far
        if not shift.any():
            return result
        total = int(num_scheduled_tokens[:count].sum())
        shift_tensor = torch.from_numpy(shift)
        self.seq_lens[:count] -= shift_tensor.to(self.seq_lens.dtype)
        self.optimistic_seq_lens_cpu[:count] -= shift_tensor.to(self.optimistic_seq_lens_cpu.dtype)
        per_token = torch.from_numpy(np.repeat(shift, num_scheduled_tokens[:count]))
        slots_at = self.positions[:total] - per_token.to(self.positions.dtype)  # positions stay logical for RoPE
        batch.block_table.compute_slot_mapping(count, self.query_start_loc.gpu[: count + 1], slots_at)
        return result

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.reasonkv_forward = []
        output = super().execute_model(scheduler_output, intermediate_tensors)
        lengths = self.reasonkv.lengths
        for request_id, computed, new, prompt in self.reasonkv_forward:
            if lengths.evicts_after(computed, new, prompt):
                self._evict(request_id, computed + new, lengths.physical(computed, prompt) + new, prompt)
        self.reasonkv_forward = []
        return output

    # ------------------------------------------------------------------ an eviction
    def _caches(self) -> list[torch.Tensor]:
        """Each decoder layer's KV cache tensor, by layer index."""
        context = self.compilation_config.static_forward_context
        named = [(extract_layer_index(name), name) for name in self.kv_cache_config.kv_cache_groups[0].layer_names]
        return [context[name].kv_cache for _, name in sorted(named)]

    def _layout(self, cache: torch.Tensor) -> BlockLayout:
        if self.reasonkv_layout is None:
            context = self.compilation_config.static_forward_context
            isa = context[self.kv_cache_config.kv_cache_groups[0].layer_names[0]].isa
            _, _, block_size, width = cache.shape

            def write(keys, values, block, slots):
                halves = block.view(block.shape[0], block.shape[1], block_size * 2, width // 2).chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(
                    keys, values, *halves, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
                )

            self.reasonkv_layout = probe_layout(write, block_size, width // 2, cache.dtype)
        return self.reasonkv_layout

    def _evict(self, request_id: str, logical: int, held: int, prompt: int) -> None:
        """Evict one request holding ``held`` tokens (``logical`` computed) down to the budget, in place."""
        spec, info = self.reasonkv.spec, self.reasonkv_info
        state = self._request(request_id)
        caches = self._caches()
        layout = self._layout(caches[0])
        request = self.requests[request_id]
        blocks = torch.tensor(request.block_ids[0], dtype=torch.long)
        read = [layout.read(cache, blocks, held) for cache in caches]
        heads = read[0][0].shape[0]
        arrived = torch.arange(state.logical, logical).view(1, 1, -1).expand(len(caches), heads, -1)
        positions = arrived if state.positions is None else torch.cat([state.positions, arrived], dim=-1)
        if positions.shape[-1] != held:
            known = positions.shape[-1]
            raise RuntimeError(f"reasonkv: request {request_id} holds {held} tokens but {known} are known")
        row = RequestRow(
            [k for k, _ in read],
            [v for _, v in read],
            positions,
            logical=logical,
            prompt=prompt,
            evictions=state.evictions,
            budget=spec.budget,
        )
        seed = noise.seed_tensor(spec.seed if isinstance(spec.seed, int) else spec.seed[0], 1, "cpu")
        kept = kept_indices(state.policy, row, info, state.recorded, seed)  # [layers, kv_heads, K]
        for cache, (keys, values), index in zip(caches, read, kept, strict=True):
            spread = index.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
            layout.write(cache, blocks, keys.gather(1, spread), values.gather(1, spread))
        state.positions, state.logical = positions.gather(-1, kept), logical
        state.evictions += 1
        # The scheduler frees the blocks past the kept tokens when it next sizes this request: trim ours alike.
        keep = self.reasonkv.lengths.blocks(kept.shape[-1], layout.block_size)
        del request.block_ids[0][keep:]
        row_index = self.input_batch.req_id_to_index[request_id]
        self.input_batch.block_table.block_tables[0].num_blocks_per_row[row_index] = keep
