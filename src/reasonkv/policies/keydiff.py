"""KeyDiff: keep the keys least similar to the head's average key direction; attention-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from reasonkv.policies.base import Policy
from reasonkv.policies.registry import register

__all__ = ["KeyDiff", "anchor_similarity"]


def anchor_similarity(keys: torch.Tensor, valid: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Cosine similarity of every key to the anchor, ``[..., slots]``.

    ``keys [..., slots, d]``; the anchor is the mean of the L2-normalised keys over the real slots
    (``valid [..., slots]``, broadcast), so padding moves neither the anchor nor any score.
    """
    keys = keys.float()
    weight = valid.to(keys.dtype).unsqueeze(-1)
    unit = keys / keys.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    anchor = (unit * weight).sum(-2, keepdim=True) / weight.sum(-2, keepdim=True).clamp(min=1.0)
    dot = (keys * anchor).sum(-1)
    return dot / (keys.norm(dim=-1) * anchor.norm(dim=-1)).clamp(min=eps)


@register
@dataclass
class KeyDiff(Policy):
    """KeyDiff (Park et al., 2025): keep, per (layer, kv-head), the keys that differ most in direction
    from the head's other keys: the score is ``-cos(k, a)``, ``a`` the mean of the L2-normalised keys.

    The paper finds that distinctive keys (low cosine similarity to the mean key direction) are the
    ones attention picks, with no attention score needed. It processes a long input block by block
    under a fixed cache size: append a block, score every cached key against the anchor of all of
    them, drop the lowest. reasonkv's ``K + B`` schedule is that iteration at decode time with
    blocks of ``B`` new tokens: at every eviction the ``K + B`` held keys form the anchor and the
    ``K`` most distinctive stay (and a prompt longer than ``K + B`` is one block, evicted once after
    prefill, rather than cut into blocks). kvpress's ``KeyDiffPress`` scores one such step, with
    ``BlockPress`` for the iteration; the score here equals its ``-cosine_similarity(keys, anchor)``.

    The keys are the cached post-RoPE keys, as in the paper's and kvpress's implementations (the
    anchor is a mean over tokens at different positions, so their rotations are part of what is
    compared). Padding slots enter neither the anchor nor the ranking; protected tokens (sinks,
    window) enter the anchor, as every held key does in the paper.

    Parameters
    ----------
    sinks, window, protect_prompt
        Protection (base class): 4 sinks, no window, prompt not protected (the paper protects nothing:
        ``sinks=0`` reproduces its rule exactly).
    """

    name: ClassVar[str] = "keydiff"
    granularity: ClassVar[str] = "head"
    chunk_exact: ClassVar[bool] = True  # stateless: reads only the stored keys at eviction time
    summary: ClassVar[str] = "keep the keys least similar (cosine) to the mean normalised key, per (layer, kv-head)"
    paper: ClassVar[str] = "https://arxiv.org/abs/2504.15364"

    def score(self, view) -> torch.Tensor:
        return -anchor_similarity(view.keys(), view.valid_mask())
