"""The eviction trace: what every (layer, kv-head) held, before and after each eviction of one row.

A :class:`TraceRecorder` attached to an :class:`~reasonkv.cache.evicting.EvictingCache` is told by the
evictor around each gather; it reads the cache and the policy's view and keeps, per evicted row, one
:class:`Eviction`. Nothing is recorded (and nothing costs) without a recorder.

Positions are kept as bit masks over the row's logical positions, packed eight to a byte
(``numpy.packbits``), and scores in float16, so that a trace of 2,048 tokens x 30 layers x 3 kv-heads x 16
evictions takes about 2 MB. A policy's per-token signals (:meth:`~reasonkv.policies.base.Policy.signals`:
EPIKV's two bands, VASE's value ranges and reserve) are kept alike, float16 or packed. Layers are the
cache's layers that hold tokens: the evicting (full-attention) layers and, on hybrid models, the
sliding-window layers (their window, the same in every head); linear layers hold no tokens and are not
traced.

Under an allocation (:mod:`reasonkv.cache.allocation`) each head holds its own number of tokens: the
masks say which, the per-token values (scores, ranks, float signals) are ``[evicting, heads, n]`` with ``n``
the most any head held, each head's own first in position order and NaN (ranks: 0) after them, and the
trace's settings carry the allocation and its ``[layers, kv_heads]`` budget table. Under ``uniform`` every head
holds ``n`` and nothing is padded: the layout of every trace written before allocations existed.
"""

from __future__ import annotations

import json
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from reasonkv.cache.allocation import adaptive_floor
from reasonkv.cache.evicting import EvictingCache
from reasonkv.policies.base import Policy
from reasonkv.policies.select import NEVER_KEEP
from reasonkv.policies.view import EvictionView

__all__ = ["Eviction", "Trace", "TraceRecorder", "by_position", "load_trace", "save_trace"]

FORMAT = "reasonkv-trace/1"
ARRAYS = ("kept", "before", "protected", "quantized", "scores", "ranks")  # an Eviction's arrays
SIGNAL = "signal."  # the file's key of a signal: "{run}.{eviction}.signal.{name}"


def pack(mask: np.ndarray) -> np.ndarray:
    """Bool ``[..., n]`` to uint8 ``[..., ceil(n / 8)]`` (big-endian bits, as ``numpy.packbits``)."""
    return np.packbits(mask, axis=-1)


def unpack(bits: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(bits, axis=-1, count=n).astype(bool)


@dataclass
class Eviction:
    """One eviction of one row. ``seen``: the row's logical tokens at that moment (positions ``0..seen-1``).

    ``kept`` ``[layers, heads, bytes]``: the positions each traced layer and head holds afterwards (either
    precision); ``quantized``: those of them held quantized (None without a quantized tier). Over the
    evicting layers only (``Trace.evicting`` indexes them among the traced ones): ``before``, the positions
    held just before; ``protected``, those the policy's sinks, window or prompt protection kept; ``scores``
    ``[evicting, heads, n]`` float16, the policy's score of each position of ``before`` in increasing
    position order (None for a policy that keeps without scoring); ``ranks``, likewise, each position's
    rank in the policy's ranking (1 = kept first; without a quantized tier the kept are ranks 1 to K;
    None for a policy that keeps without ranking). ``signals``: the policy's per-token signals by name
    (:meth:`~reasonkv.policies.base.Policy.signals`), over the positions of ``before`` in increasing order:
    a float one as float16 ``[n]`` (a token-granularity policy) or ``[evicting, heads, n]``, a set of
    positions as a packed mask ``[seen bytes]`` or ``[evicting, heads, seen bytes]`` (uint8; see
    :meth:`signal`). Every mask is packed (:func:`pack`).
    """

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
        """``[evicting, heads]``: the tokens each head of the evicting layers held just before: how many of a
        head's per-token values (``scores``, ``ranks``, float ``signals``) are its own, the rest NaN (ranks: 0)."""
        return self.before_mask().sum(-1)


@dataclass
class Trace:
    """The evictions of one generated row, and what they are over.

    ``layers``: the model's layer indices traced; ``kinds``: ``"full"`` or ``"sliding"`` for each;
    ``evicting``: the indices (into ``layers``) of the full-attention ones; ``heads``: kv-heads per layer;
    ``settings``: the cache's settings (policy and its options, budget, buffer, quantized, bits, seed; under an
    allocation also ``allocation``, ``budgets`` and the allocation's own: see :func:`settings_of`).
    """

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
        """``[evicting, heads]`` tokens each head keeps at an eviction under an allocation (``adaptive``: the
        uniform split it starts from; what each head kept is :meth:`Eviction.kept_counts`), None without one."""
        table = self.settings.get("budgets")
        return None if table is None else np.asarray(table, dtype=np.int64)

    def nbytes(self) -> int:
        """Bytes the arrays hold."""
        arrays = [getattr(e, key) for e in self.evictions for key in ARRAYS]
        arrays += [a for e in self.evictions for a in e.signals.values()]
        return sum(a.nbytes for a in arrays if a is not None)


class TraceRecorder:
    """Records every eviction of ``cache`` (attached on construction, until :meth:`detach`)."""

    def __init__(self, cache: EvictingCache):
        if cache.evictor is None:
            raise ValueError("only a cache attached to a model (EvictingCache(model=...)) evicts: nothing to trace")
        self.cache, self.policy = cache, cache.evictor.policy
        self.allocated = cache.spec.allocated  # heads hold different numbers of tokens
        kinds = cache.evictor.info.layer_kinds or ("full",) * len(cache.layers)
        traced = [(i, kind) for i, kind in enumerate(kinds) if kind in ("full", "sliding")]
        self.layers = tuple(i for i, _ in traced)
        self.kinds = tuple(kind for _, kind in traced)
        self.settings = settings_of(cache)
        self.by_row: dict[int, list[Eviction]] = defaultdict(list)
        self._pending: tuple | None = None
        cache.evictor.recorder = self
        self._reads: dict[int, tuple] = {}  # a selection policy's reads of the step in progress, by layer
        selector = getattr(cache.evictor, "selector", None)
        if selector is not None:  # selection: one record per decode step, what each (layer, head) read
            me = weakref.ref(self)
            selector.on_read = lambda *args: None if me() is None else me()._on_read(*args)

    def detach(self) -> None:
        if self.cache.evictor.recorder is self:
            self.cache.evictor.recorder = None
        selector = getattr(self.cache.evictor, "selector", None)
        if selector is not None:
            selector.on_read = None

    def _on_read(self, layer, choice, positions_read, held, scores, live) -> None:
        """A selection policy's read of one layer at a decode step; the step's record is made at its last layer.
        ``kept`` is what each (layer, kv-head) read, ``before`` what the cache held, ``protected`` the current
        block (always read), ``scores`` each held token's block score."""
        self._reads[layer] = (positions_read, held, scores, choice.blocks[:, :, -1])
        if layer != self.cache.full_layers[-1]:
            return
        reads, self._reads = [self._reads[i] for i in self.cache.full_layers], {}
        block = self.cache.evictor.selector.block_size
        for row in torch.nonzero(live).flatten().tolist():
            before = torch.stack([r[1][row] for r in reads])  # [L, H, S]
            n = int(before.max()) + 1
            positions = torch.arange(n, device=before.device)
            current = torch.stack([r[3][row] for r in reads])  # [L, H]
            protected = (positions // block).view(1, 1, -1) == current.unsqueeze(-1)
            scores = torch.stack(
                [r[2][row].float()[:, (positions // block).clamp(max=r[2].shape[-1] - 1)] for r in reads]
            )
            self.by_row[row].append(
                Eviction(
                    seen=n,
                    kept=pack(np.stack([_mask(r[0][row], n) for r in reads])),
                    before=pack(_mask(before, n)),
                    protected=pack(protected.cpu().numpy()),
                    scores=scores.to(torch.float16).cpu().numpy(),
                )
            )

    def trace(self, row: int = 0) -> Trace:
        """The trace of one row of the batch."""
        heads = self.cache.evictor.info.num_kv_heads
        return Trace(self.layers, self.kinds, heads, dict(self.settings), list(self.by_row.get(row, [])))

    # -- called by the evictor ---------------------------------------------------------------------
    def before_gather(self, view: EvictionView) -> None:
        cache, evicting = self.cache, self.cache.full_layers
        rows = view.rows.to(cache.valid.device)
        before = torch.stack([cache.positions(i).index_select(0, rows) for i in evicting], 1)  # [r, L, H, S]
        if self.policy.granularity == "token":
            protected = self._over_heads(view, view.protected(), before)
        else:
            protected = torch.stack([view.at(i).protected() for i in evicting], 1)
        scores, ranks = self._scores(view, evicting, before), self._ranks(view, evicting, before)
        self._pending = (rows, before, protected, scores, ranks, self._signals(view, evicting, before))

    def after_gather(self) -> None:
        rows, before, protected, scores, ranks, signals = self._pending
        self._pending = None
        cache = self.cache
        seen = cache.next_position.index_select(0, rows).tolist()
        kept = [cache.positions(i).index_select(0, rows) for i in self.layers]  # [r, H, S_layer] each
        quantized = None
        if cache.quantized:  # a tier's slots come first in every evicting layer
            held = cache.quantized_mask().index_select(0, rows)[:, None, :]
            evicting = [kept[i] for i, kind in enumerate(self.kinds) if kind == "full"]
            quantized = [torch.where(held, k[..., : held.shape[-1]], -1) for k in evicting]
        for j, row in enumerate(rows.tolist()):
            n = seen[j]
            eviction = Eviction(
                seen=n,
                kept=pack(np.stack([_mask(k[j], n) for k in kept])),
                before=pack(_mask(before[j], n)),
                protected=pack(_mask(torch.where(protected[j], before[j], -1), n)),
                quantized=None if quantized is None else pack(np.stack([_mask(q[j], n) for q in quantized])),
                scores=None if scores is None else _in_position_order(scores[j], before[j], torch.float16, np.nan),
                ranks=None if ranks is None else _in_position_order(ranks[j], before[j], _rank_dtype(ranks), 0),
                signals={name: self._signal_of_row(value[j], before[j], n) for name, value in signals.items()},
            )
            self.by_row[row].append(eviction)

    def _scores(self, view: EvictionView, evicting: list[int], before: torch.Tensor) -> torch.Tensor | None:
        """``[rows, L, H, S]`` scores of the stored slots, or None for a policy without ``score``."""
        if type(self.policy).score is Policy.score:
            return None
        if self.policy.granularity == "token":
            return self._over_heads(view, self.policy.score(view).float(), before)
        return torch.stack([self.policy.score(view.at(i)).float() for i in evicting], 1)

    def _over_heads(self, view: EvictionView, values: torch.Tensor, before: torch.Tensor, fill=None) -> torch.Tensor:
        """A token-granularity ``[rows, S]`` over the view's token slots as ``[rows, L, H, S]`` over every
        evicting head's own slots (``before``): the same slots in every head, unless heads hold different
        numbers of tokens (an allocation), where each head's slot takes the value of the token it holds
        (``fill`` where it holds none: see :func:`by_position`)."""
        if not self.allocated:
            return values[:, None, None, :].expand(before.shape)
        return by_position(values, view.token_positions().to(values.device), before.to(values.device), fill)

    def _signals(self, view: EvictionView, evicting: list[int], before: torch.Tensor) -> dict[str, torch.Tensor]:
        """``name -> [rows, L, H, S]``: the policy's per-token signals of the stored slots (none for most)."""
        if type(self.policy).signals is Policy.signals:
            return {}
        if self.policy.granularity == "token":
            return {name: self._over_heads(view, value, before) for name, value in self.policy.signals(view).items()}
        layers = [self.policy.signals(view.at(i)) for i in evicting]
        return {name: torch.stack([signals[name] for signals in layers], 1) for name in layers[0]}

    def _signal_of_row(self, value: torch.Tensor, before: torch.Tensor, seen: int) -> np.ndarray:
        """One row's ``[L, H, S]`` signal as the trace keeps it: float16 values in position order, or a packed
        mask of the positions in the set; one ``[n]`` / ``[bytes]`` for a token-granularity policy (every head
        alike), unless heads hold different numbers of tokens (an allocation)."""
        if value.dtype == torch.bool:
            out = pack(_mask(torch.where(value, before, -1), seen))
        else:
            out = _in_position_order(value.float(), before, torch.float16, np.nan)
        return out[0, 0] if self.policy.granularity == "token" and not self.allocated else out

    def _ranks(self, view: EvictionView, evicting: list[int], before: torch.Tensor) -> torch.Tensor | None:
        """``[rows, L, H, S]``: each slot's rank in the policy's ranking, 1 first (ties: the newer slot first,
        as ``select`` takes them), or None for a policy that keeps without ranking."""
        if not self.policy.can_rank():
            return None
        if self.policy.granularity == "token":
            ranking = self._over_heads(view, self.policy.ranking(view), before, NEVER_KEEP)
        else:
            ranking = torch.stack(self.policy.ranking_layers(view), 1)
        if self.allocated:  # a head's own padding ranks last, as the evictor ranks it
            ranking = ranking.masked_fill(before.to(ranking.device) < 0, NEVER_KEEP)
        order = torch.argsort(ranking.flip(-1), dim=-1, descending=True, stable=True)  # ties: higher index first
        slots = ranking.shape[-1]
        ranks = torch.empty_like(order)
        ranks.scatter_(-1, slots - 1 - order, torch.arange(1, slots + 1, device=order.device).expand_as(order))
        return ranks


def _rank_dtype(ranks: torch.Tensor) -> torch.dtype:
    return torch.int16 if ranks.shape[-1] < 2**15 else torch.int32


def settings_of(cache: EvictingCache) -> dict:
    """The cache's settings as JSON-able values: the policy and its options, K, B, the tier, the seed.

    Under an allocation also ``allocation``, ``budgets`` (the evictor's ``[layers, kv_heads]`` table, a list of
    lists over the evicting layers: the tokens each head keeps, summing to ``K x layers x kv_heads``; under
    ``adaptive`` the uniform split it starts from), ``ragged_heads`` (False: padded to the widest head), and
    ``adaptive_alpha`` with ``adaptive_floor`` (the tokens every head keeps first) or ``budgets_file``."""
    spec = cache.spec
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
        settings.update(
            allocation=spec.allocation,
            budgets=cache.evictor.budgets.tolist(),
            ragged_heads=spec.ragged,
        )
        if spec.allocation == "adaptive":
            settings.update(
                adaptive_alpha=spec.adaptive_alpha, adaptive_floor=adaptive_floor(spec.adaptive_alpha, spec.budget)
            )
        if spec.budgets_file is not None:
            settings["budgets_file"] = str(spec.budgets_file)
    return settings


def _mask(positions: torch.Tensor, seen: int) -> np.ndarray:
    """``[..., S]`` positions (-1: none) -> ``[..., seen]`` bool, True where held."""
    flat = positions.reshape(-1, positions.shape[-1]).long().cpu()
    mask = torch.zeros(flat.shape[0], seen + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(flat >= 0, flat, seen), True)
    return mask[:, :seen].reshape(*positions.shape[:-1], seen).numpy()


def _in_position_order(values: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, fill) -> np.ndarray:
    """``[L, H, S]`` values of slots at ``positions`` -> ``[L, H, n]`` over the held ones, by position, as
    ``dtype``; ``n`` is the most any head holds, and a head holding fewer (an allocation) has ``fill`` after its
    own. Without an allocation every head of a row holds ``n``."""
    held = (positions >= 0).cpu()
    order = torch.sort(torch.where(held, positions.cpu(), 2**62), dim=-1).indices
    counts = held.sum(-1, keepdim=True)  # [L, H, 1]
    n = int(counts.max()) if counts.numel() else 0
    out = values.cpu().gather(-1, order)[..., :n].to(dtype)
    return out.masked_fill(torch.arange(n) >= counts, fill).numpy()


def by_position(values: torch.Tensor, positions: torch.Tensor, heads: torch.Tensor, fill=None) -> torch.Tensor:
    """``values`` ``[rows, S]`` of slots holding ``positions`` ``[rows, S]`` (``-1``: padding) as the values of
    the slots of ``heads`` ``[rows, ..., S']`` (their positions): each slot takes the value of the position it
    holds; a padding slot, or a position ``positions`` lacks, takes ``fill`` (default: NaN, False or the lowest
    integer, by dtype)."""
    rows = values.shape[0]
    size = int(max(positions.max(), heads.max(), 0)) + 2  # the last index: padding and positions not found
    if fill is None:
        if values.dtype == torch.bool:
            fill = False
        else:
            fill = float("nan") if values.is_floating_point() else torch.iinfo(values.dtype).min
    dense = values.new_full((rows, size), fill)
    dense.scatter_(1, torch.where(positions >= 0, positions, size - 1).long(), values)
    dense[:, -1] = fill
    flat = heads.reshape(rows, -1)
    index = torch.where(flat >= 0, flat, size - 1).long()
    return dense.gather(1, index).reshape(heads.shape)


# -- files ------------------------------------------------------------------------------------------
def save_trace(path: Path | str, traces: dict[str, dict]) -> None:
    """Write traces (name -> ``{"trace": Trace, **json-able extras}``) to one ``.npz`` file."""
    arrays: dict[str, np.ndarray] = {}
    meta = {"format": FORMAT, "runs": {}}
    for r, (name, entry) in enumerate(traces.items()):
        trace: Trace = entry["trace"]
        extras = {k: v for k, v in entry.items() if k != "trace"}
        meta["runs"][name] = dict(
            layers=list(trace.layers),
            kinds=list(trace.kinds),
            heads=trace.heads,
            settings=trace.settings,
            seen=[e.seen for e in trace.evictions],
            index=r,
            **extras,
        )
        for e, eviction in enumerate(trace.evictions):
            for key in ARRAYS:
                value = getattr(eviction, key)
                if value is not None:
                    arrays[f"{r}.{e}.{key}"] = value
            for name, value in eviction.signals.items():
                arrays[f"{r}.{e}.{SIGNAL}{name}"] = value
    arrays["meta"] = np.frombuffer(json.dumps(meta, default=str).encode(), dtype=np.uint8)
    with open(path, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def load_trace(path: Path | str) -> dict[str, dict]:
    """Read what :func:`save_trace` wrote: name -> ``{"trace": Trace, **extras}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    try:
        data = np.load(path, allow_pickle=False)
        meta = json.loads(bytes(data["meta"]).decode())
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path} is not a reasonkv trace file ({error})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a reasonkv trace file (format {meta.get('format')!r}, expected {FORMAT})")
    out = {}
    for name, run in meta["runs"].items():
        r = run.pop("index")
        seen = run.pop("seen")
        evictions = []
        for e, n in enumerate(seen):
            parts = {k: data[f"{r}.{e}.{k}"] for k in ARRAYS if f"{r}.{e}.{k}" in data}
            prefix = f"{r}.{e}.{SIGNAL}"
            signals = {key[len(prefix) :]: data[key] for key in data.files if key.startswith(prefix)}
            evictions.append(Eviction(seen=n, **parts, signals=signals))
        trace = Trace(
            tuple(run.pop("layers")), tuple(run.pop("kinds")), run.pop("heads"), run.pop("settings"), evictions
        )
        out[name] = {"trace": trace, **run}
    return out
