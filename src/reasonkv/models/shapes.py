"""Random-weight models with the architecture of a published model (``load_model("shape:<name>")``), to measure
speed and memory without a download. Each shape is a JSON file in ``shape_configs/``: the model's transformers
config fields, plus a ``_reasonkv`` entry (description, aliases) that is not part of the config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonkv.models.devices import (
    clear_attention_error,
    resolve_attn_implementation,
    resolve_device,
    resolve_dtype,
)
from reasonkv.suggest import did_you_mean

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["SHAPES_DIR", "SHAPE_PREFIX", "list_shapes", "random_model", "shape_config"]

SHAPE_PREFIX = "shape:"
SHAPES_DIR = Path(__file__).resolve().parent / "shape_configs"
# Key in a shape JSON that documents the shape (description, aliases) and is not part of the model config.
_SHAPE_META_KEY = "_reasonkv"


def list_shapes() -> list[str]:
    """Names accepted by :func:`random_model` and ``load_model("shape:<name>")``, aliases included."""
    names = {p.stem for p in SHAPES_DIR.glob("*.json")}
    return sorted(names | set(_shape_aliases()))


def _shape_aliases() -> dict[str, str]:
    """Alias -> shape name, from the ``aliases`` listed in each shape file."""
    aliases: dict[str, str] = {}
    for path in SHAPES_DIR.glob("*.json"):
        meta = json.loads(path.read_text(encoding="utf-8")).get(_SHAPE_META_KEY, {})
        aliases.update(dict.fromkeys(meta.get("aliases", []), path.stem))
    return aliases


def shape_config(shape_name: str) -> PretrainedConfig:
    """The transformers config of a named shape, without building the model (``ValueError`` listing the shapes
    for an unknown one)."""
    from transformers import AutoConfig

    canonical = _shape_aliases().get(shape_name, shape_name) if isinstance(shape_name, str) else ""
    path = SHAPES_DIR / f"{canonical}.json"
    # The name becomes a file name: refuse anything that could point outside the shapes folder.
    if not canonical or "/" in canonical or "\\" in canonical or not path.is_file():
        hint = did_you_mean(shape_name, list_shapes())
        raise ValueError(f"Unknown shape {shape_name!r}; {hint}available shapes: {', '.join(list_shapes())}.")
    fields: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    fields.pop(_SHAPE_META_KEY, None)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def random_model(
    shape_name: str,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    *,
    seed: int = 0,
    init_std: float = 0.02,
) -> PreTrainedModel:
    """A model in eval mode with random weights and the architecture of ``shape_name`` (one of :func:`list_shapes`).

    It is created directly on ``device`` in ``dtype`` (as in :func:`~reasonkv.models.load_model`; an 8B shape on a
    GPU never materialises on the CPU; ``"meta"`` allocates no weights). Weights are drawn from a normal
    distribution of standard deviation ``init_std`` seeded by ``seed`` (the caller's RNG state is left untouched;
    norm weights are ones), so outputs are finite but meaningless: for speed and memory measurements only.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device, allow_meta=True)
    attn = resolve_attn_implementation(attn_implementation, torch_dtype, dev)
    config = shape_config(shape_name)
    # transformers' own initialisation draws normal(0, initializer_range) for linear and embedding
    # weights and sets norms to one; pinning the range keeps all shapes on the same scale.
    config.initializer_range = init_std

    cuda = [torch.cuda.current_device() if dev.index is None else dev.index] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(dev):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        with clear_attention_error(attn):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn)
    return model.eval()
