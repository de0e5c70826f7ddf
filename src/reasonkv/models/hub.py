"""Loading a hub id, the last kind of name :func:`~reasonkv.models.load_model` tries: without a reachable hub
only the local cache is read (seconds, not the hub client's retries), and an id that does not resolve gets an
error listing the names reasonkv knows itself.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from reasonkv.models.bundled import ALIASES, BUNDLED
from reasonkv.models.checkpoint import load_directory
from reasonkv.models.shapes import SHAPE_PREFIX, list_shapes

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["HUB_PROBE_SECONDS", "load_hub_id"]

# How long to wait for the hub's endpoint to answer before reading only the local cache.
HUB_PROBE_SECONDS = 3.0
# Hub ids are "name" or "owner/name" made of word characters, dots and dashes.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def load_hub_id(
    name: str, dtype: torch.dtype, device: torch.device, attn: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the model of a hub id, from the hub or, when the hub cannot be reached, from the local cache:
    ``ValueError`` for a name that is not a hub id, ``OSError`` for an id that does not resolve (unknown, or not
    cached while the hub cannot be reached)."""
    from transformers import AutoConfig

    if not _HUB_ID.match(name) or ".." in name or "--" in name:
        raise ValueError(f"Model name {name!r} is neither an existing path nor a valid hub id.")
    # Without a reachable hub, read only the local cache: the hub client would otherwise retry each
    # file for half a minute before giving up.
    offline = not _hub_reachable()
    # Resolve the config first: failures here (unknown id, no network) get one readable message
    # instead of a long download traceback.
    try:
        AutoConfig.from_pretrained(name, local_files_only=offline)
    except Exception as exc:  # hub errors come in many types; all mean "cannot resolve"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if offline:
            reason = f"the hub cannot be reached and the local cache does not hold it: {reason}"
        raise OSError(
            f"Cannot load model {name!r}: it is not a built-in name, an existing path or a resolvable hub id "
            f"({reason}). Built-in names: {', '.join([*BUNDLED, *ALIASES])}, "
            f"{SHAPE_PREFIX}<name> with <name> in {', '.join(list_shapes())}."
        ) from None
    return load_directory(name, dtype, device, attn, local_files_only=offline)


def _hub_reachable() -> bool:
    """One request to the hub's endpoint, without retries: does any answer come back in time?"""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_SECONDS)
    except Exception:  # no DNS, no route, refused, timed out, TLS: all mean "not reachable now"
        return False
    return True
