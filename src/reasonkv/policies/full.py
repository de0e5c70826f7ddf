"""The full cache: nothing is ever evicted (the reference every policy is measured against)."""

from __future__ import annotations

from dataclasses import dataclass

from reasonkv.policies.base import Policy
from reasonkv.policies.registry import register


@register
@dataclass
class Full(Policy):
    """No eviction; the budget is ignored."""

    name = "full"
    chunk_exact = True
    summary = "no eviction (the reference)"
    evicts = False
