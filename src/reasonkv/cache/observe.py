"""Signal recording: only what the active policy declares it needs (:class:`~reasonkv.policies.contract.Needs`):
hidden states of named decoder layers, the newest post-RoPE queries (a window of them, or every forward's
handed straight over), and attention rows and column sums for the attention readers, recomputed from
recorded queries and cached keys (with the kernel's soft-cap and sinks) and handed over as
:class:`~reasonkv.policies.contract.AttentionChunk` s. Only the evicting layers' attention is recorded; queries
come from the attention tap, while the model's own kernel does the attention.

Attention is owed, not paid: a decode step keeps its query, and :meth:`Observer.flush` computes the rows in
one chunked pass per layer before an eviction (or when the log grows long). Until then keys are only
appended, so each query sees exactly the keys it saw. A prefill hands over its column sums at once."""

from __future__ import annotations

import weakref

import torch

from reasonkv.cache.timing import Stopwatch
from reasonkv.hf import AttentionTap, StepCapture, decoder_layers
from reasonkv.policies import attention
from reasonkv.policies.contract import AttentionChunk, Needs, Step
from reasonkv.policies.recorded import Recorded

__all__ = ["Observer"]

LOG_LIMIT = 64  # recorded queries per layer before the observer flushes on its own (bounds their memory)
CHUNK_ELEMENTS = 1 << 24  # attention logits computed at once in a flush (bounds its memory)


def _newest(tensor: torch.Tensor) -> torch.Tensor:
    """The newest token's entry of a forward's tensor (queries ``[b, h, q, d]``, positions ``[b, q]``), in storage of
    its own: a view would keep the whole tensor alive until the log is flushed."""
    newest = tensor.narrow(tensor.dim() - 2 if tensor.dim() == 4 else 1, -1, 1)
    if newest.untyped_storage().nbytes() > newest.numel() * newest.element_size():
        return newest.clone()
    return newest


def _hidden_hook(ref: weakref.ReferenceType, index: int):
    def record(module, args, output):
        observer = ref()
        if observer is not None:
            observer.record_hidden(index, output)

    return record


class Observer:
    """Records the signals of ``needs`` for one model and one cache while ``active``. With ``model`` None no hook is
    installed: the caller hands over each forward's signals (reasonkv's vLLM worker). ``defer`` False computes
    owed attention after every forward (the per-step schedule the deferred one is checked against)."""

    def __init__(self, model: torch.nn.Module | None, cache, needs: Needs, stopwatch: Stopwatch | None = None):
        self._cache, self.needs = weakref.ref(cache), needs  # weakly: the cache owns its evictor and observer
        self.stopwatch = stopwatch or Stopwatch()
        self.active = False
        self.defer = True
        self.policy = None  # receives the attention chunks (set by the evictor)
        self.recorded = Recorded(needs.query_window)
        self.handles = []  # hook handles held by the model; the hooks hold this observer weakly
        self._step: Step | None = None
        self._logged = False  # whether this forward's newest query was logged already
        self.attention_layers = frozenset(cache.full_layers)  # only the evicting layers' attention counts
        self.reads_attention = needs.attention_last or needs.attention_sum
        self.tap = None
        if model is None:  # the caller delivers the signals (vLLM's worker: record_hidden and on_attention)
            return
        layers = decoder_layers(model)
        for index in needs.hidden_layers:
            if not 0 <= index < len(layers):
                raise ValueError(f"hidden layer {index} out of range: the model has {len(layers)} layers")
            self.handles.append(layers[index].register_forward_hook(_hidden_hook(weakref.ref(self), index)))
        if needs.taps_attention:
            self.tap = AttentionTap(model, self.on_attention)

    @property
    def cache(self):
        return self._cache()

    def record_hidden(self, index: int, output) -> None:
        if self.active:
            self._step.hidden[index] = output[0] if isinstance(output, tuple) else output

    def begin(
        self, input_valid: torch.Tensor, input_positions: torch.Tensor, position_bound: int, claim: bool = True
    ) -> None:
        """Record the forward about to run (``claim``: reclaim the modules for this tap; not for a compiled step)."""
        if claim and self.tap is not None:  # another cache on the same model may have claimed the modules since
            self.tap.claim()
        self._step = Step(input_valid=input_valid, input_positions=input_positions, position_bound=position_bound)
        self._logged = False
        self.active = True

    def end(self) -> Step:
        self.active = False
        step, self._step = self._step, None
        return step

    def settle(self) -> None:
        """After the policy has seen a forward's step: flush now if not deferring, or if the log is long."""
        if self.reads_attention and (not self.defer or len(self.recorded.log) >= LOG_LIMIT):
            self.flush()

    # ---------------------------------------------------------------- a compiled decode step's signals
    def take_capture(self, capture: StepCapture) -> None:
        """Record, between :meth:`begin` and :meth:`end`, what a compiled step wrote into ``capture``."""
        step, recorded = self._step, self.recorded
        for index in self.needs.hidden_layers:
            step.hidden[index] = capture.hidden[index].clone()  # the buffers are written again by the next step
        if self.tap is None:
            return
        for layer in sorted(self.attention_layers):
            with self.stopwatch("record"):
                keys = self.cache.attended(layer)[0]
                self.record(layer, capture.queries[layer].clone(), keys.shape[2], recorded.kernel(layer), keys)

    def detach(self) -> None:
        self.active = False
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.tap is not None:
            self.tap.close()

    # ---------------------------------------------------------------- attention tap
    def on_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, mask, kwargs: dict) -> None:
        if not self.active or layer not in self.attention_layers:
            return
        with self.stopwatch("record"):
            self.record(layer, query, key.shape[2], attention.Kernel.of(query, kwargs), key)

    def record(self, layer: int, query: torch.Tensor, slots: int, kernel: attention.Kernel, keys) -> None:
        """One layer's queries of the forward in progress, which sees ``slots`` stored keys (``keys``: only for a
        prefill's column sums), called through ``kernel`` (a compiled step's: as last seen eagerly)."""
        step, needs, recorded = self._step, self.needs, self.recorded
        recorded.scalings[layer] = kernel.scaling or query.shape[-1] ** -0.5
        if kernel.softcap is not None:
            recorded.softcaps[layer] = kernel.softcap
        if kernel.sinks is not None:
            recorded.sinks[layer] = kernel.sinks.detach()
        if needs.query_window:
            recorded.push_queries(layer, query, step.input_positions, step.input_valid)
        if needs.queries:
            self.policy.observe_queries(layer, query, step.input_positions, step.input_valid)
        if not self.reads_attention:
            return
        if needs.attention_sum and query.shape[2] > 1:
            sums = attention.column_sums(
                query,
                keys,
                self.cache.key_valid(layer),
                step.input_valid,
                recorded.kernel(layer),
            )
            self.policy.observe_attention(self._chunk(layer, step.input_positions, None, None, sums))
            if not needs.attention_last:
                return
        if not self._logged:  # the first layer of this forward logs its slot, position and validity
            recorded.log.add_forward(slots - 1, _newest(step.input_positions), _newest(step.input_valid))
            self._logged = True
        recorded.log.add_query(layer, _newest(query))

    # ---------------------------------------------------------------- the owed attention
    def flush(self) -> None:
        """Hand the policy the attention of every logged query, one batched pass per layer."""
        if not len(self.recorded.log):
            return
        with self.stopwatch("observe"), torch.inference_mode():
            oldest = self.recorded.log.slots[0]
            queries, query_slots, positions, valid = self.recorded.log.take()
            key_valid = self.cache.valid
            slots = key_valid.shape[1]
            # Without padding every query sees every slot up to the oldest one's: only the slots after it
            # need the mask (the host knows, so no device value is read).
            unmasked = 0 if self.cache.maybe_padded else oldest + 1  # slots every logged query saw
            visible = torch.arange(slots, device=key_valid.device) <= query_slots.view(-1, 1)  # [n, slots]
            visible = visible & key_valid.unsqueeze(1) & valid.unsqueeze(2)  # [batch, n, slots]
            for layer, layer_queries in queries.items():
                # A quantized tier's keys dequantized, as attention saw them; float32 once for every chunk.
                keys = self.cache.attended(layer)[0].float()
                b, hq, n, _ = layer_queries.shape
                kernel = self.recorded.kernel(layer)
                sinks = None if kernel.sinks is None else kernel.sinks.float().view(1, hq, 1, 1)
                step = max(1, CHUNK_ELEMENTS // max(1, b * hq * slots))
                for start in range(0, n, step):
                    part = layer_queries[:, :, start : start + step]
                    seen = visible[:, start : start + step]
                    logits = attention.grouped_logits(part, keys, kernel.scaling, kernel.softcap).view(
                        b, hq, part.shape[2], slots
                    )
                    hidden = seen[..., unmasked:].unsqueeze(1)
                    if self.cache.allocated:  # heads hold padding of their own
                        hidden = hidden & attention.key_mask(self.cache.key_valid(layer)[..., unmasked:], hq)
                    rows = attention.masked_softmax_(logits, hidden, sinks, start=unmasked)
                    sums = rows.sum(2) if self.needs.attention_sum else None
                    chunk_rows = rows if self.needs.attention_last else None
                    self.policy.observe_attention(
                        self._chunk(layer, positions[:, start : start + step], seen, chunk_rows, sums)
                    )

    def _chunk(self, layer, query_positions, visible, rows, sums) -> AttentionChunk:
        return AttentionChunk(
            layer=layer,
            slot_positions=self.cache.positions(layer),
            query_positions=query_positions,
            visible=visible,
            position_bound=self.cache.seen,
            rows=rows,
            column_sums=sums,
        )
