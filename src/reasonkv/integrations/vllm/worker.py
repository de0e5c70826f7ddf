"""vLLM's CPU worker whose runner keeps positions logical (RoPE) but sequence lengths and slots physical, and,
after each forward, lets the policy evict the requests that reached ``K + B`` (docs/vllm.md).

The runner is vLLM's own V1 ``CPUModelRunner`` with three methods wrapped: ``_prepare_inputs`` (physical lengths
and slots), ``execute_model`` (the evictions after the forward) and ``_update_states`` (finished and resumed
requests). Each request is a one-row cache (:mod:`.rows`) with reasonkv's own observer and policy, fed by hooks as
the model computes; an eviction reads its blocks densely (:mod:`.paged`), asks the policy which tokens stay,
writes them into the first blocks in order and trims the block table as the scheduler will.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from reasonkv.cache.observe import Observer
from reasonkv.hf import model_info
from reasonkv.integrations.vllm.config import Settings, settings_of
from reasonkv.integrations.vllm.paged import BlockLayout, probe_layout
from reasonkv.integrations.vllm.rows import RequestCache, kept_indices, rotary_of
from reasonkv.policies import noise
from reasonkv.policies.attention import Kernel

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
    """What the worker keeps of an evicting request: its tokens as a one-row cache, its policy, and the observer
    that records the signals the policy reads (as reasonkv's own cache does, fed by the worker's hooks)."""

    cache: RequestCache
    policy: object
    observer: Observer


class EvictingCPURunner(CPUModelRunner):
    """``CPUModelRunner`` whose requests hold at most ``K + B`` tokens once evicting (see the module doc)."""

    def reasonkv_setup(self, settings: Settings) -> None:
        self.reasonkv = settings
        self.reasonkv_info = model_info(self.model_config.hf_config)
        self.reasonkv_needs = settings.spec.policy.needs(self.reasonkv_info)
        self.reasonkv_requests: dict[str, _Request] = {}
        # The tokens a request had when it resumed after a preemption: its prompt from then on (see physical.py).
        self.reasonkv_starts: dict[str, int] = {}
        self.reasonkv_forward: list[tuple[str, int, int, int]] = []  # (request, computed, new, prompt)
        self.reasonkv_layout: BlockLayout | None = None
        self.reasonkv_caches: list[torch.Tensor] | None = None  # each layer's KV cache tensor, once allocated
        self.reasonkv_hooks: list | None = None  # on the layers whose signals the policy reads, once loaded

    def _request(self, request_id: str) -> _Request:
        state = self.reasonkv_requests.get(request_id)
        if state is None:
            spec, info = self.reasonkv.spec, self.reasonkv_info
            read = functools.partial(self._read, request_id)
            cache = RequestCache(read, info, self.model_config.get_num_kv_heads(self.parallel_config), spec.budget)
            policy = spec.new_policy()
            policy.reset(info, 1, torch.device("cpu"))
            observer = Observer(None, cache, self.reasonkv_needs)
            observer.policy = policy
            state = self.reasonkv_requests[request_id] = _Request(cache, policy, observer)
        return state

    # ------------------------------------------------------------------ the signals, as the model computes them
    def _hook(self) -> None:
        """Hooks that hand each request's signals to its observer during a forward (eager mode, which the config
        check requires of a policy that reads any): each attention layer's post-RoPE queries (and keys), and the
        residual stream after each decoder layer the policy reads. The model's rotations join its info here (the
        policies that rotate keys back read them), as vLLM's own rotary modules hold them."""
        self.reasonkv_hooks = []
        needs = self.reasonkv_needs
        layers = {}  # the decoder layers, by index: the modules named `...layers.<index>`
        for name, module in self.get_model().named_modules():
            found = re.fullmatch(r"(?:.*\.)?layers\.(\d+)", name)
            if found:
                layers[int(found.group(1))] = module
        rotary = tuple(rotary_of(layers[index], self.reasonkv_info.head_dim) for index in sorted(layers))
        self.reasonkv_info = dataclasses.replace(self.reasonkv_info, rotary=rotary)
        if needs.taps_attention:
            context = self.compilation_config.static_forward_context
            for name in self.kv_cache_config.kv_cache_groups[0].layer_names:
                module = context[name]
                hook = functools.partial(self._capture_attention, extract_layer_index(name))
                self.reasonkv_hooks.append(module.register_forward_pre_hook(hook))
        for index in needs.hidden_layers:
            hook = functools.partial(self._capture_hidden, index)
            self.reasonkv_hooks.append(layers[index].register_forward_hook(hook))

    def _per_request(self, *tensors: torch.Tensor):
        """Each request of the forward in progress, its new token count and its rows of ``[tokens, ...]`` tensors."""
        start = 0
        for request_id, _, new, _ in self.reasonkv_forward:
            yield request_id, new, [t[start : start + new] for t in tensors]
            start += new

    def _capture_attention(self, layer: int, module, args) -> None:
        heads, kv_heads, head_dim = module.num_heads, module.num_kv_heads, module.head_size
        # The kernel's own scaling and soft-cap, so that the policy's recomputed attention is the model's.
        kernel = Kernel(module.impl.scale, getattr(module.impl, "logits_soft_cap", None) or None)
        for request_id, new, (query, key) in self._per_request(args[0], args[1]):
            state = self.reasonkv_requests[request_id]
            held = state.cache.held
            keys = None
            if self.reasonkv_needs.attention_sum and new > 1:
                # A multi-token forward's column sums see the keys held before it and its own (not in the blocks
                # yet: the layer writes them after this hook), as reasonkv's storage shows them to attention.
                before, _ = self._read(request_id, layer, held - new)
                ours = key.reshape(new, kv_heads, head_dim).transpose(0, 1)
                keys = torch.cat([before, ours], dim=1).unsqueeze(0)
            queries = query.reshape(new, heads, head_dim).transpose(0, 1).unsqueeze(0).clone()
            state.observer.record(layer, queries, held, kernel, keys)

    def _capture_hidden(self, layer: int, module, args, output) -> None:
        hidden, residual = output  # vLLM defers each layer's residual add to the next layer's fused norm
        stream = hidden if residual is None else hidden + residual
        for request_id, _, (rows,) in self._per_request(stream):
            self.reasonkv_requests[request_id].observer.record_hidden(layer, rows.unsqueeze(0))

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
        if self.reasonkv_hooks is None:
            self._hook()
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
        for request_id, c, n, p in self.reasonkv_forward:  # the forward begins: its tokens are held from now on
            state = self._request(request_id)
            state.cache.prompt = p
            state.cache.grow(n)
            positions = torch.arange(c, c + n).unsqueeze(0)
            state.observer.begin(torch.ones(1, n, dtype=torch.bool), positions, c + n, claim=False)
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
            state = self.reasonkv_requests[request_id]
            step = state.observer.end()  # the forward's signals, handed over as reasonkv's own cache does
            state.policy.observe(step)
            state.observer.settle()
            if lengths.evicts_after(computed, new, prompt):
                self._evict(request_id, computed + new, lengths.physical(computed, prompt) + new)
        self.reasonkv_forward = []
        return output

    # ------------------------------------------------------------------ an eviction
    def _caches(self) -> list[torch.Tensor]:
        """Each decoder layer's KV cache tensor, by layer index (bound once the engine has allocated them, then
        fixed: looked up once, not at every read)."""
        if self.reasonkv_caches is None:
            context = self.compilation_config.static_forward_context
            groups = self.kv_cache_config.kv_cache_groups[0]
            named = sorted((extract_layer_index(name), name) for name in groups.layer_names)
            self.reasonkv_caches = [context[name].kv_cache for _, name in named]
        return self.reasonkv_caches

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

    def _read(self, request_id: str, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` tokens a request holds in one layer: keys, values ``[kv_heads, count, head_dim]``."""
        caches = self._caches()
        blocks = torch.tensor(self.requests[request_id].block_ids[0], dtype=torch.long)
        return self._layout(caches[0]).read(caches[layer], blocks, count)

    def _evict(self, request_id: str, logical: int, held: int) -> None:
        """Evict one request holding ``held`` tokens (``logical`` computed) down to the budget, in place."""
        spec, state = self.reasonkv.spec, self.reasonkv_requests[request_id]
        cache = state.cache
        if (cache.held, cache.seen) != (held, logical):
            raise RuntimeError(
                f"reasonkv: request {request_id} holds {held} of {logical} tokens but {cache.held} of "
                f"{cache.seen} are known"
            )
        state.observer.flush()  # the attention the policy is owed, before it scores
        seed = noise.seed_tensor(spec.seed if isinstance(spec.seed, int) else spec.seed[0], 1, "cpu")
        kept = kept_indices(state.policy, cache, self.reasonkv_info, state.observer.recorded, seed)
        caches = self._caches()
        layout = self._layout(caches[0])
        request = self.requests[request_id]
        blocks = torch.tensor(request.block_ids[0], dtype=torch.long)
        for layer, (cache_tensor, index) in enumerate(zip(caches, kept, strict=True)):
            keys, values = (t[0] for t in cache.attended(layer))
            spread = index.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
            layout.write(cache_tensor, blocks, keys.gather(1, spread), values.gather(1, spread))
        cache.keep(kept)
        # The scheduler frees the blocks past the kept tokens when it next sizes this request: trim ours alike.
        keep = self.reasonkv.lengths.blocks(kept.shape[-1], layout.block_size)
        del request.block_ids[0][keep:]
        row_index = self.input_batch.req_id_to_index[request_id]
        self.input_batch.block_table.block_tables[0].num_blocks_per_row[row_index] = keep
