"""EPIKV: epiphany-aware eviction from residual-stream changes, without any attention matrix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.calibration import Calibration, check_layers, default_anatomy, load_calibration
from reasonkv.policies.common import PositionTable
from reasonkv.policies.contract import Needs, Step
from reasonkv.policies.epikv_signal import (
    lag_normalise,
    rolling_zscore,
    step_distances,
    window_mean,
    window_positions,
)
from reasonkv.policies.options import check_at_least, check_choice, check_option
from reasonkv.policies.registry import register
from reasonkv.suggest.integers import is_int

__all__ = ["EPIKV", "EPIKVLag", "VARIANTS"]

VARIANTS = ("raw", "zscore", "band", "lag")
PENDING_RULES = ("recent", "neutral")
_BAND_ALLOWED = "a non-empty tuple of layer indices (integers >= 0), or text such as '7..13' or '1,5'"
_WINDOW_ELEMENTS = 1 << 22  # bound on the gathered history of a long prefill


@register
@dataclass
class EPIKV(Policy):
    """Score each token by how much it moved the residual stream, in an "important" layer against a
    "filler" layer; keep the highest scores (EPIKV). One kept set for every layer and head.

    The signal of layer ``l`` at logical position ``t`` is ``g_l(t) = ||h_l(t) - h_l(t-1)||_2``, ``h_l`` the
    output of decoder layer ``l``, computed in :meth:`observe` for the used layers only: one float per token
    and used layer (a :class:`~reasonkv.policies.common.PositionTable`), never attention. Every score is
    causal (``lag``: up to the end of the chunk after it), so scoring lazily at eviction, in one vectorised
    pass, gives what scoring each token as it arrived would.

    Parameters
    ----------
    variant
        The score: ``"zscore"`` (default), ``"raw"``, ``"band"`` or ``"lag"``, as follows.
        ``"zscore"`` (default, the paper's main method): ``s = z_a - z_b`` with the causal rolling
        z-score ``z_l(t) = (g_l(t) - mu) / (sigma + eps)``, ``mu``/``sigma`` the mean and population
        std of the defined ``g_l`` at positions ``t - W .. t - 1`` (``W = stats_window``); fewer than
        2 defined values give ``z = 0``. This removes the positional trend of raw ``g``.
        ``"raw"``: ``s = gbar_a - gbar_b``, ``gbar`` the mean of the defined ``g`` over
        ``t - m + 1 .. t`` (``m = smooth``).
        ``"band"``: as ``zscore`` with ``z_a``, ``z_b`` replaced by the mean ``z_l`` over the layers
        of ``band_a`` and ``band_b``.
        ``"lag"`` (lag-normalised, the paper's best AIME variant): positions are cut into chunks of
        ``lag`` tokens; the ``g_l`` of chunk ``c`` are normalised by the mean and population std of
        ``g_l`` over chunk ``c + 1``, ``s = z_a - z_b``. A chunk is scored (finalised) once the chunk
        after it is complete, so the newest 1-2 chunks (between ``lag`` and ``2 * lag - 1`` tokens)
        are *pending*; see ``pending``.
    stats_window
        ``W`` of the rolling z-score (default 128).
    smooth
        ``m`` of the ``raw`` moving average (default 1: ``g`` itself).
    lag
        Chunk length of the ``lag`` variant (default 128, LagKV's usual lag and the default buffer).
    pending
        What pending (not yet finalised) ``lag`` tokens score at eviction. ``"recent"`` (default):
        they rank above every finalised token, newest first, so the not-yet-judged tail is kept
        (the buffer protects them anyway) while never overrunning the budget: if
        they alone exceed it, the oldest pending ones go first. ``"neutral"``: they score 0 (the
        neutral z) and compete with the finalised tokens. Ignored by the other variants.
    eps
        Added to ``sigma`` in every normalisation (default ``1e-6``).
    a, b
        The two layers of ``raw``, ``zscore`` and ``lag`` (0 = first decoder layer). Default: the
        paper's 10 and 21 of 32 layers scaled by depth, ``round(10 L / 32)`` and ``round(21 L / 32)``
        (halves up), i.e. 9 and 20 for 30 layers; or the calibration file's.
    band_a, band_b
        The layers of the ``band`` variant (tuples; text such as ``"7..13"`` or ``"1,5"``, a list or one int also work).
        Default: 7..13 and 18..25 of 32 with both ends scaled by depth (7..12 and 17..23 for 30
        layers); or the calibration file's.
    calibration
        Path of a calibration JSON (see :mod:`reasonkv.policies.calibration`) providing ``a``, ``b``,
        ``band_a``, ``band_b``; its ``num_layers`` must match the model. Explicit ``a``/``b``/band
        options override the file, which overrides the depth-scaled defaults.

    Where the paper is silent, and hybrid models: ``docs/policy-choices.md``.
    """

    name: ClassVar[str] = "epikv"
    summary: ClassVar[str] = "residual-stream change, important band vs filler band (attention-free)"
    paper: ClassVar[str] = "https://arxiv.org/abs/2606.26472"
    chunk_exact: ClassVar[bool] = True

    variant: str = "zscore"
    stats_window: int = 128
    smooth: int = 1
    lag: int = 128
    pending: str = "recent"
    eps: float = 1e-6
    a: int | None = None
    b: int | None = None
    band_a: tuple[int, ...] | None = None
    band_b: tuple[int, ...] | None = None
    calibration: str | None = None

    def __post_init__(self) -> None:
        for option in ("band_a", "band_b"):  # text and single layers become tuples before the type check
            setattr(self, option, self._band(option))
        super().__post_init__()
        check_choice(self, "variant", VARIANTS)
        check_choice(self, "pending", PENDING_RULES)
        check_at_least(self, "stats_window", 2)
        check_at_least(self, "smooth", 1)
        check_at_least(self, "lag", 2)
        check_option(self, "eps", self.eps > 0, "a positive number")
        self.eps = float(self.eps)
        for option in ("a", "b"):
            value = getattr(self, option)
            check_option(self, option, value is None or value >= 0, "a layer index (an integer >= 0)")
        for option in ("band_a", "band_b"):
            band = getattr(self, option)
            check_option(self, option, band is None or (len(band) > 0 and min(band) >= 0), _BAND_ALLOWED)
        self._calibration: Calibration | None = None
        if self.calibration is not None:
            self.calibration = os.fspath(self.calibration)  # a path is taken as its text
            self._calibration = load_calibration(self.calibration)
        self._state: _State | None = None

    def _band(self, option: str) -> object:
        """``band_a``/``band_b`` as a tuple when given as text (``"7..13"``, ``"1,5"``), one layer, a list
        or a range; anything else as it came, for the type check to judge."""
        value = getattr(self, option)
        if isinstance(value, str):
            first, dots, last = value.partition("..")
            try:
                if dots:
                    return tuple(range(int(first), int(last) + 1))
                return tuple(int(part) for part in value.split(",") if part.strip())
            except ValueError:
                raise ValueError(f"{self.name}: {option} must be {_BAND_ALLOWED}, got {value!r}") from None
        if is_int(value):
            return (value,)
        return tuple(value) if isinstance(value, (list, range)) else value

    # -- layers -------------------------------------------------------------------------------------
    def anatomy(self, num_layers: int) -> Calibration:
        """The layers used on a model of ``num_layers`` layers (options > calibration file > scaled)."""
        if self._calibration is not None:
            if self._calibration.num_layers != num_layers:
                raise ValueError(
                    f"{self.name}: calibration file {self.calibration!r} is for a model with "
                    f"{self._calibration.num_layers} layers ({self._calibration.model or 'unnamed'}), "
                    f"but this model has {num_layers} layers"
                )
            base = self._calibration
        else:
            base = default_anatomy(num_layers)
        chosen = {
            option: getattr(base if getattr(self, option) is None else self, option)
            for option in ("a", "b", "band_a", "band_b")
        }
        for option, value in chosen.items():
            check_layers(option, value, num_layers, owner=self.name)
        return Calibration(num_layers=num_layers, model=base.model, **chosen)

    def used_layers(self, num_layers: int) -> tuple[int, ...]:
        """The decoder layers whose hidden states this policy reads."""
        anatomy = self.anatomy(num_layers)
        layers = anatomy.band_a + anatomy.band_b if self.variant == "band" else (anatomy.a, anatomy.b)
        return tuple(sorted(set(layers)))

    def needs(self, info) -> Needs:
        return Needs(hidden_layers=self.used_layers(info.num_layers))

    # -- state --------------------------------------------------------------------------------------
    def reset(self, info, batch: int, device: torch.device) -> None:
        anatomy = self.anatomy(info.num_layers)
        used = self.used_layers(info.num_layers)
        column = {layer: i for i, layer in enumerate(used)}
        if self.variant == "band":  # z_A, z_B: means over the bands
            side_a, side_b = anatomy.band_a, anatomy.band_b
        else:
            side_a, side_b = (anatomy.a,), (anatomy.b,)
        self._state = _State(
            layers=used,
            a=[column[layer] for layer in side_a],
            b=[column[layer] for layer in side_b],
            previous=None,
            has_previous=torch.zeros(batch, dtype=torch.bool, device=device),
            seen=torch.zeros(batch, dtype=torch.long, device=device),
            table=PositionTable(batch, (len(used) + 1,), fill=float("nan"), device=device),
            scored=torch.zeros(batch, dtype=torch.long, device=device),
        )

    def observe(self, step: Step) -> None:
        """Record ``g`` of this forward's tokens; scores follow lazily (see :meth:`_score_pending`)."""
        state = self._state
        if state is None:
            raise RuntimeError(f"{self.name}: observe() before reset()")
        missing = [layer for layer in state.layers if layer not in step.hidden]
        if missing:
            raise RuntimeError(f"{self.name}: the step carries no hidden states of layers {missing}")
        valid = step.input_valid
        signals, lasts = [], []  # g [batch, q] of each used layer (step_distances), its newest hidden vector
        for i, layer in enumerate(state.layers):
            hidden = step.hidden[layer]
            if state.previous is None:
                state.previous = hidden.new_zeros(
                    (hidden.shape[0], len(state.layers), hidden.shape[-1]), dtype=torch.float32
                )
            g, last = step_distances(hidden, valid, state.previous[:, i], state.has_previous)
            signals.append(g)
            lasts.append(last)
        state.previous = torch.stack(lasts, dim=1)
        state.has_previous |= valid.any(dim=1)
        state.seen = state.seen + valid.sum(dim=1)
        g = torch.stack(signals, dim=1)  # [batch, used, q]
        unscored = g.new_full((g.shape[0], 1, g.shape[2]), float("nan"))
        # Every position seen is below the step's bound, a host-side fact (0: not given, read it instead).
        state.bound = step.position_bound or None
        state.table.set(step.input_positions, torch.cat([g, unscored], dim=1), bound=state.bound)

    def _score_pending(self) -> None:
        """Score every token that can be scored but is not yet: all observed tokens (``lag``: those
        whose following chunk is complete). Scores are causal, so computing them here, in one
        vectorised pass at eviction time, gives exactly what computing each as it arrived would;
        a decode step then costs only its norms."""
        state = self._state
        ready = state.seen if self.variant != "lag" else (state.seen // self.lag - 1).clamp(min=0) * self.lag
        count = ready - state.scored
        width = int(count.max())
        if width <= 0:
            return
        offsets = torch.arange(width, device=ready.device)
        positions = (state.scored.unsqueeze(1) + offsets).masked_fill(offsets >= count.unsqueeze(1), -1)
        used = len(state.layers)
        g = state.table.get(positions, bound=state.bound)[:, :used]
        if self.variant == "lag":  # whole chunks: positions start on a chunk boundary
            batch, lag = positions.shape[0], self.lag
            following = (positions + lag).masked_fill(positions < 0, -1)
            reference = state.table.get(following, bound=state.bound)[:, :used].reshape(batch, used, -1, lag)
            z = lag_normalise(g.reshape(batch, used, -1, lag), reference, self.eps).flatten(-2)
            s = _side(z, state.a) - _side(z, state.b)
        else:
            side_a, side_b = self._causal_sides(
                positions, g, lambda at: state.table.get(at, bound=state.bound)[:, :used]
            )
            s = (side_a - side_b).nan_to_num(0.0) if self.variant == "raw" else side_a - side_b
        state.table.set(positions, torch.cat([g, s.unsqueeze(1)], dim=1), bound=state.bound)
        state.scored = ready.clone()

    def _causal_sides(self, positions: torch.Tensor, g: torch.Tensor, read) -> tuple[torch.Tensor, torch.Tensor]:
        """``(side_a, side_b)`` ``[batch, q]`` of the non-``lag`` variants (``raw``: ``gbar_a``, ``gbar_b``,
        ``NaN`` where undefined; else ``z_a``, ``z_b``): the score is their difference. ``read(positions)``
        gives the table's ``g`` ``[batch, used, n]`` at ``positions`` ``[batch, n]``."""
        batch, used, q = g.shape
        if self.variant == "raw":
            start, length = 1 - self.smooth, self.smooth
        else:
            start, length = -self.stats_window, self.stats_window
        chunk = max(1, _WINDOW_ELEMENTS // max(1, batch * (used + 1) * length))
        sides_a, sides_b = [], []
        for lo in range(0, q, chunk):
            hi = min(q, lo + chunk)
            history = read(window_positions(positions[:, lo:hi], start, length)).reshape(batch, used, hi - lo, length)
            z = window_mean(history) if self.variant == "raw" else rolling_zscore(g[..., lo:hi], history, self.eps)
            sides_a.append(_side(z, self._state.a))
            sides_b.append(_side(z, self._state.b))
        return torch.cat(sides_a, dim=-1), torch.cat(sides_b, dim=-1)

    # -- eviction -----------------------------------------------------------------------------------
    def token_scores(self, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The stored scores ``s`` of the tokens at ``positions`` ``[rows, S]`` (``-1``: padding).

        ``NaN`` marks padding and ``lag`` tokens not finalised yet. ``rows`` selects batch rows
        (default: all, in order). This is what :meth:`score` ranks, before the pending rule.
        """
        state = self._state
        if state is None:
            raise RuntimeError(f"{self.name}: no generation observed yet (reset() not called)")
        self._score_pending()
        if rows is None:
            rows = torch.arange(positions.shape[0], device=positions.device)
        return state.table.lookup(rows, positions, len(state.layers))

    def score(self, view) -> torch.Tensor:
        positions = view.token_positions()
        scores = self.token_scores(positions, view.rows)
        if self.variant != "lag" or self.pending == "neutral":
            return scores.nan_to_num(0.0)
        # "recent": pending tokens above every finalised one, newest first. Ranks keep the keys exact
        # integers in float32 whatever the magnitude of the scores.
        pending = scores.isnan() & (positions >= 0)
        finalised = scores.masked_fill(scores.isnan(), float("-inf"))
        rank = finalised.argsort(dim=-1).argsort(dim=-1).float()
        return torch.where(pending, scores.shape[-1] + positions.float(), rank)

    def signals(self, view) -> dict[str, torch.Tensor]:
        """The two sides of the score of each stored token, ``[rows, slots]``: ``band_a`` (``z_a``, the
        important layer or band) and ``band_b`` (``z_b``, the filler one), whose difference is ``s``
        (``raw``: ``gbar_a`` and ``gbar_b``). ``NaN`` for padding and tokens not scored yet (``lag``'s
        pending ones). Recomputed from the stored ``g`` by the score's own maths; the state changes only as
        :meth:`score` changes it (tokens due are scored)."""
        positions, rows = view.token_positions(), view.rows
        unscored = self.token_scores(positions, rows).isnan()  # scores whatever is due first
        state = self._state
        used = range(len(state.layers))

        def read(at: torch.Tensor) -> torch.Tensor:
            return torch.stack([state.table.lookup(rows, at, column) for column in used], dim=1)

        g = read(positions)
        if self.variant == "lag":  # each token against the chunk after its own, as _score_pending does
            following = ((positions // self.lag + 1) * self.lag).unsqueeze(-1) + torch.arange(self.lag, device=g.device)
            reference = read(following.flatten(-2)).reshape(*g.shape, self.lag)
            z = lag_normalise(g.unsqueeze(-1), reference, self.eps).squeeze(-1)
            side_a, side_b = _side(z, state.a), _side(z, state.b)
        else:
            side_a, side_b = self._causal_sides(positions, g, read)
        return {
            "band_a": side_a.masked_fill(unscored, float("nan")),
            "band_b": side_b.masked_fill(unscored, float("nan")),
        }


@register
@dataclass
class EPIKVLag(EPIKV):
    """EPIKV with the lag-normalised score (``variant="lag"``), the paper's best AIME variant.

    Identical to :class:`EPIKV` (see there for every option) except for the default ``variant``.
    """

    name: ClassVar[str] = "epikv-lag"
    summary: ClassVar[str] = "EPIKV, each chunk normalised by the chunk after it (attention-free)"

    variant: str = "lag"


def _side(values: torch.Tensor, columns: list[int]) -> torch.Tensor:
    """Mean over the used-layer columns of one side: ``[batch, used, ...] -> [batch, ...]``."""
    return values[:, columns[0]] if len(columns) == 1 else values[:, columns].mean(1)


@dataclass
class _State:
    layers: tuple[int, ...]  # used decoder layers, in column order
    a: list[int]  # columns of the "important" side: layer a, or band A for the band variant
    b: list[int]  # columns of the "filler" side: layer b, or band B
    previous: torch.Tensor | None  # [batch, used, dim] last real hidden vector per row and layer
    has_previous: torch.Tensor  # [batch] bool
    seen: torch.Tensor  # [batch] real tokens observed per row
    table: PositionTable  # [batch, used + 1, positions]: g_l(t) per used layer, then s(t); NaN = missing
    scored: torch.Tensor  # [batch] positions 0 .. scored - 1 of each row carry their final score
    bound: int | None = None  # every position observed so far is below it (None: unknown)
