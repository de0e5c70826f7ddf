"""reasonkv's eviction policies inside vLLM (docs/vllm.md).

vLLM loads :func:`register` through its ``vllm.general_plugins`` entry point in every process it starts: an engine
config whose ``additional_config`` has a ``reasonkv`` key is checked (:mod:`.config`) and routed to reasonkv's
scheduler (:mod:`.scheduler`) and worker (:mod:`.worker`); without it nothing changes.
"""

from __future__ import annotations

import functools

from vllm.config import VllmConfig

from reasonkv.integrations.vllm.config import configure

__all__ = ["register"]


def register() -> None:
    """Wrap ``VllmConfig.__post_init__`` once (vLLM may load plugins several times in one process)."""
    original = VllmConfig.__post_init__
    if getattr(original, "_reasonkv", False):
        return

    @functools.wraps(original)
    def post_init(self) -> None:
        original(self)
        model = self.model_config
        if model is not None and not model.is_submodel_config:  # a view of a config already checked
            configure(self)

    post_init._reasonkv = True
    VllmConfig.__post_init__ = post_init
