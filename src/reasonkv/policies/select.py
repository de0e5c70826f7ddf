"""Pure tensor functions that turn scores into the indices of the tokens to keep (no model, cache or
transformers import: a serving engine can reuse them).

The last dimension is the stored-slot axis ``S`` (``[rows, S]`` per token, ``[rows, heads, S]`` per head);
``valid`` marks real tokens, ``protected`` tokens that must survive; returned indices are sorted. Among
equal scores the more recent token (the higher slot) is kept, on every device, and random draws are keyed
by logical position (:mod:`reasonkv.policies.noise`). Budget checks read a device value: inside
:func:`checks_at_exit` they are read once when the block ends, one synchronisation per eviction.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from reasonkv.policies import noise

__all__ = [
    "MUST_KEEP",
    "NEVER_KEEP",
    "check_counts",
    "checks_at_exit",
    "gumbel_noise",
    "keep_ranked",
    "keep_sampled",
    "keep_top",
    "protected_mask",
    "rank_order",
    "rank_sampled",
    "rank_top",
    "reserve_top",
    "top_indices",
    "value_range",
]

# What a ranking holds for protected and for padding slots. Finite so that arithmetic on them stays NaN-free.
MUST_KEEP = torch.finfo(torch.float32).max
NEVER_KEEP = -torch.finfo(torch.float32).max


def protected_mask(
    positions: torch.Tensor,
    *,
    sinks: int,
    window: int,
    newest: torch.Tensor,
    prompt_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slots that no policy may evict: of ``positions`` ``[rows, ..., S]`` (negative for padding), the first
    ``sinks``, the ``window`` most recent (``> newest - window``, ``newest`` ``[rows]``), and with
    ``prompt_lengths`` ``[rows]`` every prompt position."""
    shape = (-1,) + (1,) * (positions.dim() - 1)
    keep = positions < sinks
    if window > 0:
        keep |= positions > (newest.view(shape) - window)
    if prompt_lengths is not None:
        keep |= positions < prompt_lengths.view(shape)
    return keep & (positions >= 0)


def _selection_keys(scores: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    # Scores stay strictly between the two sentinels (NaN ranks with -inf), so a ranking alone says
    # which slots are protected and which are padding.
    keys = scores.float().nan_to_num(nan=NEVER_KEEP / 2, posinf=MUST_KEEP / 2, neginf=NEVER_KEEP / 2)
    keys = keys.clamp(NEVER_KEEP / 2, MUST_KEEP / 2).masked_fill(protected, MUST_KEEP)
    return keys.masked_fill(~valid, NEVER_KEEP)


# open checks_at_exit blocks, innermost last: (two device counts, the check that reads them) each
_PENDING: list[list[tuple[torch.Tensor, Callable[[int, int], None]]]] = []


@contextlib.contextmanager
def checks_at_exit() -> Iterator[None]:
    """Collect the budget checks of the selections made inside the block; raise after it, reading once."""
    pending: list[tuple[torch.Tensor, Callable[[int, int], None]]] = []
    _PENDING.append(pending)
    try:
        yield
    finally:
        _PENDING.pop()
    if pending:
        counts = torch.stack([c.to(pending[0][0].device) for c, _ in pending]).tolist()
        for (first, second), (_, check) in zip(counts, pending, strict=True):
            check(first, second)


def check_counts(counts: torch.Tensor, check: Callable[[int, int], None]) -> None:
    """Call ``check`` with the two numbers of the device tensor ``counts`` ``[2]``: inside
    :func:`checks_at_exit` when the block ends (one host read for all its checks), else now."""
    if _PENDING:
        _PENDING[-1].append((counts, check))
    else:
        check(*counts.tolist())


def _raise_if_short(n_protected: int, n_valid: int, k: int) -> None:
    if n_protected > k:
        raise ValueError(
            f"{n_protected} protected tokens exceed the budget of {k}: lower sinks/window, "
            "turn off protect_prompt, or raise the budget"
        )
    if n_valid < k:
        raise ValueError(f"cannot keep {k} tokens from a row holding only {n_valid}")


def _check_capacity(valid: torch.Tensor, protected: torch.Tensor, k: int) -> None:
    if not valid.numel():
        return
    counts = torch.stack([(protected & valid).sum(-1).amax(), valid.sum(-1).amin()])
    check_counts(counts, lambda n_protected, n_valid: _raise_if_short(n_protected, n_valid, k))


def _tie_broken(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` (float, no NaN) as distinct int64 with the same order, ties ordered by index (the higher
    index larger): the float's bits made order-preserving, then the index in the low 32 bits. Lets
    ``topk`` (a partial selection) stand in for a stable full sort."""
    bits = (keys.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 and 0.0 are one value, as they compare
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    return (ordered.long() << 32) | torch.arange(keys.shape[-1], device=keys.device)


def rank_order(keys: torch.Tensor) -> torch.Tensor:
    """Every index along the last axis, best first: ``keys`` (no NaN) descending, ties to the higher index,
    the order :func:`top_indices` takes from (so its ``k`` first are the top ``k``)."""
    return _tie_broken(keys).sort(dim=-1, descending=True).values & 0xFFFFFFFF


def top_indices(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest ``keys`` (no NaN: rankings hold none) along the last axis, ascending;
    ties go to the higher index."""
    chosen = _tie_broken(keys).topk(k, dim=-1, sorted=False).values & 0xFFFFFFFF
    return chosen.sort(dim=-1).values


def rank_top(scores: torch.Tensor, *, valid: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """The ranking :func:`keep_top` keeps from: the scores, protected slots at :data:`MUST_KEEP`,
    padding at :data:`NEVER_KEEP` (``valid`` and ``protected`` broadcast against ``scores``)."""
    scores, valid, protected = torch.broadcast_tensors(scores, valid, protected)
    return _selection_keys(scores, valid, protected)


def keep_ranked(ranking: torch.Tensor, *, k: int) -> torch.Tensor:
    """The ``k`` highest-ranked slots of a ranking from :func:`rank_top` / :func:`rank_sampled` (ties
    go to the newer slot).

    Refuses more protected slots than ``k``, or fewer real ones. Returns sorted indices ``[..., k]``.
    """
    _check_capacity(ranking > NEVER_KEEP, ranking >= MUST_KEEP, k)
    return top_indices(ranking, k)


def keep_top(scores: torch.Tensor, *, valid: torch.Tensor, protected: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the protected tokens, then the highest-scoring others, ``k`` in all.

    ``valid`` and ``protected`` broadcast against ``scores``. Returns sorted indices ``[..., k]``.
    """
    return keep_ranked(rank_top(scores, valid=valid, protected=protected), k=k)


def gumbel_noise(valid: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise shaped like ``valid`` ``[rows, ..., S]``; ``-inf`` at padding.

    The value at a slot is keyed by the row's seed (``seeds`` ``[rows]``, int64), the slot's inner
    index (head) and the token's logical position (``positions``, broadcast to ``valid``), so a row's
    draws never depend on the batch, on padding or on the device.
    """
    if seeds.shape[0] != valid.shape[0]:
        raise ValueError(f"need one seed per row: got {seeds.shape[0]} for {valid.shape[0]} rows")
    rows, *inner, slots = valid.shape
    inner_index = torch.arange(math.prod(inner), dtype=torch.int64, device=valid.device).view(1, *inner, 1)
    seeds = seeds.to(valid.device).view(rows, *([1] * len(inner)), 1)
    hashed = noise.mix(seeds, inner_index, positions.to(valid.device).expand(valid.shape))
    return noise.gumbel(hashed).masked_fill(~valid, float("-inf"))


def keep_sampled(weights: torch.Tensor, *, k: int, **sampling) -> torch.Tensor:
    """Keep the protected tokens, then sample the rest without replacement, ``P ∝ weight``.

    Gumbel-top-k: the ``k`` largest ``log(weight) / temperature + Gumbel`` are an exact sample
    without replacement from the weights tempered by ``temperature``. Tokens of zero weight are
    taken only when nothing else is left. ``sampling`` is what :func:`rank_sampled` takes (``valid``,
    ``protected``, ``seeds`` ``[rows]``, ``positions`` the slots' logical positions, ``temperature``).
    Returns sorted indices ``[..., k]``.
    """
    return keep_ranked(rank_sampled(weights, **sampling), k=k)


def rank_sampled(
    weights: torch.Tensor,
    *,
    valid: torch.Tensor,
    protected: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The ranking :func:`keep_sampled` keeps from: ``log(weight) / temperature`` plus Gumbel noise
    (keyed by each row's seed and the slots' positions, :func:`gumbel_noise`), protected slots at :data:`MUST_KEEP`,
    padding at :data:`NEVER_KEEP`. Taken in descending order it is a sample without replacement."""
    weights, valid, protected = torch.broadcast_tensors(weights, valid, protected)
    logw = weights.float().clamp(min=0).log() / temperature
    draws = gumbel_noise(valid, seeds, positions)
    # Zero-weight tokens sort below every positive one but above padding.
    perturbed = torch.where(torch.isfinite(logw), logw + draws, torch.full_like(logw, -1e30) + draws)
    return _selection_keys(perturbed, valid, protected)


def value_range(values: torch.Tensor) -> torch.Tensor:
    """``max(v) - min(v)`` over the head dimension: ``[..., S, D] -> [..., S]``."""
    return values.amax(dim=-1).float() - values.amin(dim=-1).float()


def reserve_top(scores: torch.Tensor, *, valid: torch.Tensor, protected: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Mask of the slots to reserve before filling a budget of ``k``: the ``n`` highest-scoring
    valid, unprotected slots, capped so that protected + reserved never exceed ``k``.

    The building block of "reserve, then fill" selection (reserve some tokens by one criterion,
    fill the rest of the budget by another): pass ``protected | reserve_top(...)`` as the
    ``protected`` argument of :func:`keep_top` or :func:`keep_sampled`. ``valid`` and ``protected``
    broadcast against ``scores``; per leading index, at most ``max(0, min(n, k - protected))``
    slots are reserved. NaN and infinite scores are never reserved.
    """
    scores, valid, protected = torch.broadcast_tensors(scores, valid, protected)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    m = min(n, scores.shape[-1])
    if m <= 0:
        return mask
    candidates = valid & ~protected
    keys = scores.float().nan_to_num(nan=float("-inf"), posinf=float("-inf"))
    keys = keys.masked_fill(~candidates, float("-inf"))
    room = (k - (protected & valid).sum(-1, keepdim=True)).clamp(min=0, max=m)
    # Best first; ties go to the more recent token, as in top_indices.
    indices = _tie_broken(keys).topk(m, dim=-1).values & 0xFFFFFFFF
    values = keys.gather(-1, indices)
    take = (torch.arange(m, device=scores.device) < room) & torch.isfinite(values)
    return mask.scatter_(-1, indices, take)
