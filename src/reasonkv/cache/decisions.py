"""What the evictor decided at each eviction (:class:`Decision`), and the trace a :class:`DecisionLog` keeps of
it: one :class:`Eviction` per evicted row, which :mod:`reasonkv.inspect` saves and shows. Nothing is
recorded (nor costs) without a log.

Positions are bit masks over the row's logical positions (``numpy.packbits``), scores and float signals
float16: 2,048 tokens x 30 layers x 3 kv-heads x 16 evictions take about 2 MB. The traced layers are those
holding tokens: the evicting ones and, on hybrid models, the sliding-window ones (their window in every
head). Under an allocation the per-token values are ``[evicting, heads, n]`` with ``n`` the most any head
held, each head's own first in position order and NaN (ranks: 0) after them, and the settings carry the
``[layers, kv_heads]`` budget table; under ``uniform`` nothing is padded."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from reasonkv.cache.spec import CacheSpec

__all__ = ["ARRAYS", "Decision", "DecisionLog", "Eviction", "Trace", "by_position", "settings_of"]

ARRAYS = ("kept", "before", "protected", "quantized", "scores", "ranks")  # an Eviction's arrays


@dataclass
class Decision:
    """One eviction of ``rows`` as the evictor made it (the fields of :class:`Eviction`, unpacked):
    ``[rows, evicting layers, kv_heads, slots]`` in slot order (``before``: positions, -1 none), ``ranking`` the
    priority kept by. ``shared``: every evicting head holds the same tokens. After the gather: ``seen``, and
    the positions held per traced layer (``quantized``: per evicting layer)."""

    rows: torch.Tensor
    shared: bool
    before: torch.Tensor
    protected: torch.Tensor
    scores: torch.Tensor | None
    ranking: torch.Tensor | None
    signals: dict[str, torch.Tensor]
    seen: list[int] = field(default_factory=list)
    after: list[torch.Tensor] = field(default_factory=list)
    quantized: list[torch.Tensor] | None = None


def pack(mask: np.ndarray) -> np.ndarray:
    """Bool ``[..., n]`` to uint8 ``[..., ceil(n / 8)]`` (big-endian bits, as ``numpy.packbits``)."""
    return np.packbits(mask, axis=-1)


def unpack(bits: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(bits, axis=-1, count=n).astype(bool)


@dataclass
class Eviction:
    """One eviction of one row; ``seen``: the row's logical tokens then (positions ``0..seen-1``). Every mask is
    packed (:func:`pack`).

    ``kept`` ``[layers, heads, bytes]``: the positions each traced layer and head holds afterwards;
    ``quantized``: those held in the tier (None without one). Over the evicting layers (``Trace.evicting``):
    ``before``, the positions held just before; ``protected``, those kept by sinks, window or prompt
    protection; ``scores`` ``[evicting, heads, n]`` float16, the policy's score of each position of ``before``
    in position order (None: keeps without scoring); ``ranks``, each one's rank (1 = kept first; None: keeps
    without ranking). ``signals``: the policy's per-token signals by name over ``before``'s positions, float16
    ``[n]`` (token granularity) or ``[evicting, heads, n]``, or a set as a packed mask (see :meth:`signal`)."""

    seen: int
    kept: np.ndarray
    before: np.ndarray
    protected: np.ndarray
    quantized: np.ndarray | None = None
    scores: np.ndarray | None = None
    ranks: np.ndarray | None = None
    signals: dict[str, np.ndarray] = field(default_factory=dict)

    def signal(self, name: str) -> np.ndarray:
        """One signal: float16 values as recorded, or a set of positions unpacked to bool ``[..., seen]``."""
        value = self.signals[name]
        return unpack(value, self.seen) if value.dtype == np.uint8 else value

    def kept_mask(self) -> np.ndarray:
        """``[layers, heads, seen]`` bool."""
        return unpack(self.kept, self.seen)

    def before_mask(self) -> np.ndarray:
        return unpack(self.before, self.seen)

    def protected_mask(self) -> np.ndarray:
        return unpack(self.protected, self.seen)

    def quantized_mask(self) -> np.ndarray | None:
        return None if self.quantized is None else unpack(self.quantized, self.seen)

    def kept_counts(self) -> np.ndarray:
        """``[layers, heads]``: the tokens each traced layer's head holds afterwards (under ``adaptive``, what the
        layer-wide selection gave it at this eviction)."""
        return self.kept_mask().sum(-1)

    def held_counts(self) -> np.ndarray:
        """``[evicting, heads]``: tokens each evicting head held just before (how many of its values are its own)."""
        return self.before_mask().sum(-1)


@dataclass
class Trace:
    """The evictions of one generated row: ``layers`` traced and their ``kinds`` (``"full"`` or ``"sliding"``),
    ``heads`` per layer, and ``settings`` (see :func:`settings_of`)."""

    layers: tuple[int, ...]
    kinds: tuple[str, ...]
    heads: int
    settings: dict
    evictions: list[Eviction] = field(default_factory=list)

    @property
    def evicting(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.kinds) if kind == "full")

    @property
    def budgets(self) -> np.ndarray | None:
        """``[evicting, heads]`` tokens each head keeps under an allocation (``adaptive``: its start), or None."""
        table = self.settings.get("budgets")
        return None if table is None else np.asarray(table, dtype=np.int64)

    def nbytes(self) -> int:
        """Bytes the arrays hold."""
        arrays = [getattr(e, key) for e in self.evictions for key in ARRAYS]
        arrays += [a for e in self.evictions for a in e.signals.values()]
        return sum(a.nbytes for a in arrays if a is not None)


class DecisionLog:
    """Every decision of the evictor of ``cache`` (an :class:`~reasonkv.cache.evicting.EvictingCache`), kept per
    row as :class:`Eviction` records; listening from construction (until ``cache.evictor.listen(None)``)."""

    def __init__(self, cache):
        evictor = cache.evictor
        if evictor is None:
            raise ValueError("only a cache attached to a model (EvictingCache(model=...)) evicts: nothing to trace")
        self.layers, self.kinds = zip(*evictor.held_layers, strict=True)
        self.heads = evictor.info.num_kv_heads
        self.settings = settings_of(cache.spec, evictor.budgets)
        self.by_row: dict[int, list[Eviction]] = defaultdict(list)
        self._full_layers = list(cache.full_layers)
        selector = getattr(evictor, "selector", None)  # a selection policy's cache (reasonkv.cache.selecting)
        self._block = None if selector is None else selector.policy.block_size
        self._reads: dict[int, tuple] = {}  # a selection policy's reads of the step in progress, by layer
        evictor.listen(self)

    def trace(self, row: int = 0) -> Trace:
        """The trace of one row of the batch."""
        return Trace(self.layers, self.kinds, self.heads, dict(self.settings), list(self.by_row.get(row, [])))

    def record(self, decision: Decision) -> None:
        """One eviction: a record for each of its rows."""
        before, scores, quantized = decision.before, decision.scores, decision.quantized
        ranks = None if decision.ranking is None else _ranks(decision.ranking)
        for j, row in enumerate(decision.rows.tolist()):
            n, held = decision.seen[j], before[j]
            self.by_row[row].append(
                Eviction(
                    seen=n,
                    kept=pack(np.stack([_mask(after[j], n) for after in decision.after])),
                    before=pack(_mask(held, n)),
                    protected=pack(_mask(torch.where(decision.protected[j], held, -1), n)),
                    quantized=None if quantized is None else pack(np.stack([_mask(q[j], n) for q in quantized])),
                    scores=None if scores is None else _in_position_order(scores[j], held, torch.float16, np.nan),
                    ranks=None if ranks is None else _in_position_order(ranks[j], held, _rank_dtype(ranks), 0),
                    signals={k: _signal_of_row(v[j], held, n, decision.shared) for k, v in decision.signals.items()},
                )
            )

    def read(self, layer, choice, positions_read, held, scores, live) -> None:
        """A selection policy's read of one layer at a decode step, recorded at the step's last layer: ``kept`` what
        each (layer, kv-head) read, ``before`` what it held, ``protected`` the current block, ``scores`` the blocks'."""
        self._reads[layer] = (positions_read, held, scores, choice.blocks[:, :, -1])
        if layer != self._full_layers[-1]:
            return
        reads, self._reads = [self._reads[i] for i in self._full_layers], {}
        for row in torch.nonzero(live).flatten().tolist():
            before = torch.stack([r[1][row] for r in reads])  # [L, H, S]
            n = int(before.max()) + 1
            blocks = torch.arange(n, device=before.device) // self._block  # each position's block
            current = torch.stack([r[3][row] for r in reads])  # [L, H]
            scores = torch.stack([r[2][row].float()[:, blocks.clamp(max=r[2].shape[-1] - 1)] for r in reads])
            self.by_row[row].append(
                Eviction(
                    seen=n,
                    kept=pack(np.stack([_mask(r[0][row], n) for r in reads])),
                    before=pack(_mask(before, n)),
                    protected=pack((blocks.view(1, 1, -1) == current.unsqueeze(-1)).cpu().numpy()),
                    scores=scores.to(torch.float16).cpu().numpy(),
                )
            )


def settings_of(spec: CacheSpec, budgets: torch.Tensor | None) -> dict:
    """The cache's settings as JSON values: the policy and its options, K, B, the tier, the seed; under an
    allocation also ``allocation``, ``budgets`` (the ``[layers, kv_heads]`` table), ``ragged_heads`` and the
    allocation's own (``adaptive_alpha`` with ``adaptive_floor``, or ``budgets_file``)."""
    settings = {
        **spec.policy.config(),
        "granularity": spec.policy.granularity,
        "selects": spec.selects,
        "budget": spec.budget,
        "buffer": spec.buffer,
        "quantized": spec.quantized,
        "bits": spec.bits,
        "seed": list(spec.seed) if isinstance(spec.seed, tuple) else spec.seed,
    }
    if spec.allocated:  # uniform traces keep the keys they always had
        settings.update(allocation=spec.allocation, budgets=budgets.tolist(), ragged_heads=spec.ragged)
        settings.update(spec.allocation_rule.trace_settings(spec.budget))
    return settings


def by_position(values: torch.Tensor, positions: torch.Tensor, heads: torch.Tensor, fill=None) -> torch.Tensor:
    """``values`` ``[rows, S]`` of slots holding ``positions`` (ascending, ``-1`` first) as the values of the slots
    of ``heads`` ``[rows, ..., S']``: each takes its position's value, or ``fill`` (default NaN, False or the lowest
    integer) for padding or a missing position. How a token policy's values reach each allocated head."""
    if fill is None:
        if values.dtype == torch.bool:
            fill = False
        else:
            fill = float("nan") if values.is_floating_point() else torch.iinfo(values.dtype).min
    flat = heads.reshape(heads.shape[0], -1).to(positions.device)
    index = torch.searchsorted(positions.contiguous(), flat.contiguous()).clamp(max=positions.shape[-1] - 1)
    found = (positions.gather(1, index) == flat) & (flat >= 0)
    return values.gather(1, index.to(values.device)).masked_fill(~found.to(values.device), fill).reshape(heads.shape)


def _ranks(ranking: torch.Tensor) -> torch.Tensor:
    """Each slot's rank in ``ranking`` (``[..., S]``), 1 first; ties: the newer slot first, as ``select`` takes them."""
    order = torch.argsort(ranking.flip(-1), dim=-1, descending=True, stable=True)  # ties: higher index first
    slots = ranking.shape[-1]
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, slots - 1 - order, torch.arange(1, slots + 1, device=order.device).expand_as(order))
    return ranks


def _rank_dtype(ranks: torch.Tensor) -> torch.dtype:
    return torch.int16 if ranks.shape[-1] < 2**15 else torch.int32


def _signal_of_row(value: torch.Tensor, before: torch.Tensor, seen: int, shared: bool) -> np.ndarray:
    """One row's ``[L, H, S]`` signal as the trace keeps it: float16 values in position order, or a packed mask
    of the positions in the set; one ``[n]`` / ``[bytes]`` when every layer and head holds the same tokens."""
    if value.dtype == torch.bool:
        out = pack(_mask(torch.where(value, before, -1), seen))
    else:
        out = _in_position_order(value.float(), before, torch.float16, np.nan)
    return out[0, 0] if shared else out


def _mask(positions: torch.Tensor, seen: int) -> np.ndarray:
    """``[..., S]`` positions (-1: none) -> ``[..., seen]`` bool, True where held."""
    flat = positions.reshape(-1, positions.shape[-1]).long().cpu()
    mask = torch.zeros(flat.shape[0], seen + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(flat >= 0, flat, seen), True)
    return mask[:, :seen].reshape(*positions.shape[:-1], seen).numpy()


def _in_position_order(values: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, fill) -> np.ndarray:
    """``[L, H, S]`` values of slots at ``positions`` as ``[L, H, n]`` over the held ones, by position, as ``dtype``;
    ``n`` is the most any head holds, and a head holding fewer has ``fill`` after its own."""
    held = (positions >= 0).cpu()
    order = torch.sort(torch.where(held, positions.cpu(), 2**62), dim=-1).indices
    counts = held.sum(-1, keepdim=True)  # [L, H, 1]
    n = int(counts.max()) if counts.numel() else 0
    out = values.cpu().gather(-1, order)[..., :n].to(dtype)
    return out.masked_fill(torch.arange(n) >= counts, fill).numpy()
