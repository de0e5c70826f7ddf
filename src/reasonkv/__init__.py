"""reasonkv: keep the KV cache of long chain-of-thought decoding within a fixed budget.

Quick start::

    import reasonkv
    model, tokenizer = reasonkv.load_model("smollm2-135m")
    [result] = reasonkv.generate(model, tokenizer, "2 + 2 = ?", policy="streaming", budget=256)
"""

from reasonkv.cache import EvictingCache
from reasonkv.generate import GenerationResult, generate
from reasonkv.policies import Policy, get_policy, list_policies, register

__version__ = "0.1.0"


def load_model(*args, **kwargs):
    """Load a model and its tokenizer; see :func:`reasonkv.models.load_model`."""
    from reasonkv.models import load_model as _load

    return _load(*args, **kwargs)


__all__ = [
    "EvictingCache",
    "GenerationResult",
    "Policy",
    "generate",
    "get_policy",
    "list_policies",
    "load_model",
    "register",
]
