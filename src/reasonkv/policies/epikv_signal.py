"""The EPIKV signal maths: pure tensor functions, no model, cache or transformers import.

Missing values are ``NaN`` throughout (the first token of a sequence has no predecessor, so no
``g``); every function that turns ``g`` into a score maps a missing result to the neutral ``0``.
"""

from __future__ import annotations

import torch

__all__ = ["step_distances", "window_positions", "window_mean", "rolling_zscore", "lag_normalise"]

_CHUNK_ELEMENTS = 1 << 24  # bound on the transient tensors of a long prefill


def step_distances(
    hidden: torch.Tensor, valid: torch.Tensor, previous: torch.Tensor, has_previous: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g(t) = ||h(t) - h(t-1)||_2`` for the tokens of one forward pass.

    ``hidden`` ``[batch, q, dim]`` is one layer's output for them, ``valid`` ``[batch, q]`` the real ones; a
    token's predecessor is the row's previous real token, in this forward or else ``previous`` ``[batch, dim]``
    (float32; ``has_previous`` ``[batch]`` says whether there is one). Returns ``(g, last)``: ``g``
    ``[batch, q]`` float32, ``NaN`` for padding and a row's first token, and the row's newest real hidden
    vector ``[batch, dim]`` (``previous`` if none arrived).
    """
    batch, q, dim = hidden.shape
    if q == 1:  # decode: one subtraction and one norm
        current = hidden[:, 0].float()
        g = torch.linalg.vector_norm(current - previous, dim=-1)
        g = g.masked_fill(~(valid[:, 0] & has_previous), float("nan")).unsqueeze(1)
        last = torch.where(valid[:, :1], current, previous)
        return g, last
    index = torch.arange(q, device=hidden.device).expand(batch, q)
    last_at = torch.where(valid, index, -1).cummax(dim=1).values  # last real token at or before j
    before = torch.cat([last_at.new_full((batch, 1), -1), last_at[:, :-1]], dim=1)  # strictly before j
    defined = valid & ((before >= 0) | has_previous.unsqueeze(1))
    g = torch.empty((batch, q), dtype=torch.float32, device=hidden.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, batch * dim))
    for start in range(0, q, chunk):
        stop = min(q, start + chunk)
        current = hidden[:, start:stop].float()
        source = before[:, start:stop]
        gathered = hidden.gather(1, source.clamp(min=0).unsqueeze(-1).expand(-1, -1, dim)).float()
        predecessor = torch.where((source >= 0).unsqueeze(-1), gathered, previous.unsqueeze(1))
        g[:, start:stop] = torch.linalg.vector_norm(current - predecessor, dim=-1)
    g = g.masked_fill(~defined, float("nan"))
    newest = last_at[:, -1]
    rows = torch.arange(batch, device=hidden.device)
    last = torch.where((newest >= 0).unsqueeze(1), hidden[rows, newest.clamp(min=0)].float(), previous)
    return g, last


def window_positions(positions: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Positions ``t + start .. t + start + length - 1`` for each ``t``: ``[batch, q] -> [batch, q * length]``.

    Negative results (before the sequence) and the windows of padding (``t < 0``) come out as
    ``-1``, which :class:`~reasonkv.policies.common.PositionTable` reads as its fill value.
    """
    offsets = torch.arange(start, start + length, device=positions.device)
    window = positions.unsqueeze(-1) + offsets
    window = window.masked_fill((window < 0) | (positions < 0).unsqueeze(-1), -1)
    return window.flatten(-2)


def window_mean(window: torch.Tensor) -> torch.Tensor:
    """Mean of the defined (non-NaN) values over the last axis; ``NaN`` where none is defined."""
    defined = ~window.isnan()
    total = torch.where(defined, window, 0.0).sum(-1)
    return total / defined.sum(-1)  # 0 / 0 = NaN where nothing is defined


def rolling_zscore(current: torch.Tensor, history: torch.Tensor, eps: float) -> torch.Tensor:
    """``(g - mu) / (sigma + eps)`` against the defined values of ``history``.

    ``current`` is ``[...]``, ``history`` ``[..., W]`` (``NaN`` = missing); ``mu`` and ``sigma`` are the
    mean and the population standard deviation of the defined history. Neutral ``0`` when ``current``
    is missing or fewer than 2 history values are defined.
    """
    return lag_normalise(current.unsqueeze(-1), history, eps).squeeze(-1)


def lag_normalise(chunks: torch.Tensor, following: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise each chunk by the statistics of the chunk after it: ``[..., lag]`` each.

    ``z = (g - mean(following)) / (std(following) + eps)`` (population std of the defined values);
    neutral ``0`` where ``g`` is missing or the following chunk holds fewer than 2 defined values.
    """
    defined = ~following.isnan()
    count = defined.sum(-1, keepdim=True)
    n = count.clamp(min=1)
    mu = torch.where(defined, following, 0.0).sum(-1, keepdim=True) / n
    sigma = (torch.where(defined, following - mu, 0.0).square().sum(-1, keepdim=True) / n).sqrt()
    z = (chunks - mu) / (sigma + eps)
    return torch.where((count >= 2) & ~chunks.isnan(), z, 0.0)
