"""Pure tensor functions that turn scores into the indices of the tokens to keep.

Shared by every policy. Nothing here imports transformers or knows about models or caches, so a
serving engine can reuse this file (and ``policies/``) unchanged.

Conventions: the last dimension of every tensor is the stored-slot axis ``S``; leading dimensions
are free (``[rows, S]`` for per-token selection, ``[rows, heads, S]`` for per-head selection).
``valid`` marks slots that hold a real token (not padding); ``protected`` marks tokens that must
survive. Returned indices are sorted ascending, so kept tokens stay in their original order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "MUST_KEEP",
    "NEVER_KEEP",
    "protected_mask",
    "keep_top",
    "keep_sampled",
    "keep_ranked",
    "rank_top",
    "rank_sampled",
    "gumbel_noise",
    "value_range",
    "reserve_top",
]

# Keys for "must keep" and "never keep" slots. Finite so that arithmetic on them stays NaN-free.
_MUST = torch.finfo(torch.float32).max
_NEVER = -torch.finfo(torch.float32).max
MUST_KEEP, NEVER_KEEP = _MUST, _NEVER  # what a ranking holds for protected and for padding slots


def protected_mask(
    positions: torch.Tensor,
    *,
    sinks: int,
    window: int,
    newest: torch.Tensor,
    prompt_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slots that no policy may evict.

    Parameters
    ----------
    positions
        Logical positions of the stored slots, ``[rows, ..., S]`` (negative for padding).
    sinks
        The first ``sinks`` logical positions are kept (attention sinks).
    window
        The ``window`` most recent tokens are kept: positions ``> newest - window``.
    newest
        Logical position of the newest token of each row, ``[rows]``.
    prompt_lengths
        When given, every prompt position (``< prompt_lengths``) is kept, ``[rows]``.
    """
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
    keys = scores.float().nan_to_num(nan=_NEVER / 2, posinf=_MUST / 2, neginf=_NEVER / 2)
    keys = keys.clamp(_NEVER / 2, _MUST / 2).masked_fill(protected, _MUST)
    return keys.masked_fill(~valid, _NEVER)


def _check_capacity(valid: torch.Tensor, protected: torch.Tensor, k: int) -> None:
    n_protected = int((protected & valid).sum(-1).max()) if protected.numel() else 0
    if n_protected > k:
        raise ValueError(
            f"{n_protected} protected tokens exceed the budget of {k}: lower sinks/window, "
            "turn off protect_prompt, or raise the budget"
        )
    n_valid = int(valid.sum(-1).min()) if valid.numel() else 0
    if n_valid < k:
        raise ValueError(f"cannot keep {k} tokens from a row holding only {n_valid}")


def rank_top(scores: torch.Tensor, *, valid: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """The ranking :func:`keep_top` keeps from: the scores, protected slots at :data:`MUST_KEEP`,
    padding at :data:`NEVER_KEEP` (``valid`` and ``protected`` broadcast against ``scores``)."""
    valid, protected = torch.broadcast_tensors(valid, protected)
    scores, valid, protected = torch.broadcast_tensors(scores, valid, protected)
    return _selection_keys(scores, valid, protected)


def keep_ranked(ranking: torch.Tensor, *, k: int) -> torch.Tensor:
    """The ``k`` highest-ranked slots of a ranking from :func:`rank_top` / :func:`rank_sampled`.

    Refuses more protected slots than ``k``, or fewer real ones. Returns sorted indices ``[..., k]``.
    """
    _check_capacity(ranking > _NEVER, ranking >= _MUST, k)
    return ranking.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def keep_top(scores: torch.Tensor, *, valid: torch.Tensor, protected: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the protected tokens, then the highest-scoring others, ``k`` in all.

    ``valid`` and ``protected`` broadcast against ``scores``. Returns sorted indices ``[..., k]``.
    """
    return keep_ranked(rank_top(scores, valid=valid, protected=protected), k=k)


def gumbel_noise(valid: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Standard Gumbel noise shaped like ``valid`` ``[rows, ..., S]``; each row from its own generator.

    A row draws exactly one value per real (valid) slot, in slot order, so its draws do not depend
    on how much padding the batch adds around it: a prompt decoded in a batch makes the same random
    choices as when decoded alone. Padding slots get ``-inf``.
    """
    if len(generators) != valid.shape[0]:
        raise ValueError(f"need one generator per row: got {len(generators)} for {valid.shape[0]} rows")
    noise = torch.full(valid.shape, float("-inf"), device=valid.device)
    for row, generator in enumerate(generators):
        mask = valid[row]
        uniform = torch.rand(int(mask.sum()), generator=generator, device=valid.device)
        uniform = uniform.clamp_(min=1e-20, max=1.0 - 1e-7)
        noise[row][mask] = -torch.log(-torch.log(uniform))
    return noise


def keep_sampled(
    weights: torch.Tensor,
    *,
    valid: torch.Tensor,
    protected: torch.Tensor,
    k: int,
    generators: Sequence[torch.Generator],
    temperature: float = 1.0,
) -> torch.Tensor:
    """Keep the protected tokens, then sample the rest without replacement, ``P ∝ weight``.

    Gumbel-top-k: the ``k`` largest ``log(weight) / temperature + Gumbel`` are an exact sample
    without replacement from the weights tempered by ``temperature``. Tokens of zero weight are
    taken only when nothing else is left. Returns sorted indices ``[..., k]``.
    """
    ranking = rank_sampled(weights, valid=valid, protected=protected, generators=generators, temperature=temperature)
    return keep_ranked(ranking, k=k)


def rank_sampled(
    weights: torch.Tensor,
    *,
    valid: torch.Tensor,
    protected: torch.Tensor,
    generators: Sequence[torch.Generator],
    temperature: float = 1.0,
) -> torch.Tensor:
    """The ranking :func:`keep_sampled` keeps from: ``log(weight) / temperature`` plus Gumbel noise
    (one draw per real slot, from each row's generator), protected slots at :data:`MUST_KEEP`,
    padding at :data:`NEVER_KEEP`. Taken in descending order it is a sample without replacement."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    valid, protected = torch.broadcast_tensors(valid, protected)
    weights, valid, protected = torch.broadcast_tensors(weights, valid, protected)
    logw = weights.float().clamp(min=0).log() / temperature
    noise = gumbel_noise(valid, generators)
    # Zero-weight tokens sort below every positive one but above padding.
    perturbed = torch.where(torch.isfinite(logw), logw + noise, torch.full_like(logw, -1e30) + noise)
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
    valid, protected = torch.broadcast_tensors(valid, protected)
    scores, valid, protected = torch.broadcast_tensors(scores, valid, protected)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    m = min(n, scores.shape[-1])
    if m <= 0:
        return mask
    candidates = valid & ~protected
    keys = scores.float().nan_to_num(nan=float("-inf"), posinf=float("-inf"))
    keys = keys.masked_fill(~candidates, float("-inf"))
    room = (k - (protected & valid).sum(-1, keepdim=True)).clamp(min=0, max=m)
    top = keys.topk(m, dim=-1, sorted=True)
    take = (torch.arange(m, device=scores.device) < room) & torch.isfinite(top.values)
    return mask.scatter_(-1, top.indices, take)
