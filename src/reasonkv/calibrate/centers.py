"""``reasonkv calibrate --centers``: the query centers TriAttention scores keys with, for any model.

:class:`CentersSettings` says what to read (a dataset's reference solutions after their prompts, or
a plain-text file, as the TriAttention authors calibrate) and where to write;
:func:`run_centers` runs the model over it (full cache, one forward per sequence), takes every
full-attention layer's post-RoPE queries from the attention tap, rotates them back to pre-RoPE space
with the model's own rotary tables and writes their per-(layer, head) complex mean and mean modulus
(:class:`~reasonkv.policies.query_centers.QueryCenters`), stamped with the model's shape and weights
fingerprint so that the policy refuses them on another model.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from reasonkv.calibrate.traces import reference_trace
from reasonkv.eval.datasets import load_dataset
from reasonkv.hf import AttentionTap, model_info
from reasonkv.models import DEFAULT_MODEL, load_model
from reasonkv.policies.query_centers import CenterSums, QueryCenters

__all__ = ["CentersSettings", "compute_centers", "run_centers"]


@dataclass(frozen=True, kw_only=True)
class CentersSettings:
    """Everything one ``reasonkv calibrate --centers`` run is told.

    Parameters
    ----------
    model, dtype, device, attn
        The model to load.
    dataset, traces
        Read the reference solutions of the first ``traces`` problems of ``dataset``, each after its
        prompt (ignored when ``text`` is given).
    text
        A plain-text file read as one sequence instead (any coherent text: the authors' choice).
    max_tokens
        Cut every sequence to this many tokens (None: whole).
    out
        The file to write (a new path, or a query centers file this command wrote, which is replaced).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "fp32"
    device: str = "cpu"
    attn: str = "sdpa"
    dataset: str = "gsm8k"
    traces: int = 100
    text: Path | None = None
    max_tokens: int | None = None
    out: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", os.fspath(self.model))
        object.__setattr__(self, "out", Path(self.out))
        if self.text is not None:
            object.__setattr__(self, "text", Path(self.text))
            if not self.text.is_file():
                raise ValueError(f"--text {str(self.text)!r} is not a file")
        for name in ("traces", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.out.is_dir():
            raise ValueError(f"--out {str(self.out)!r} is a folder; --centers writes one file")
        if self.out.exists():
            try:
                QueryCenters.load(self.out)
            except ValueError:
                raise ValueError(
                    f"--out {str(self.out)!r} exists and is not a query centers file; it is left untouched"
                ) from None

    @property
    def source(self) -> str:
        """What the centers are computed on, as the file records it."""
        cut = f", at most {self.max_tokens} tokens each" if self.max_tokens else ""
        if self.text is not None:
            return f"text file {self.text.name}{cut}"
        return f"{self.dataset}: {self.traces} reference solutions after their prompts{cut}"

    def command(self) -> str:
        parts = ["reasonkv", "calibrate", "--centers", "--model", self.model]
        if self.dtype != "fp32":
            parts += ["--dtype", self.dtype]
        if self.text is not None:
            parts += ["--text", str(self.text)]
        else:
            parts += ["--dataset", self.dataset, "--traces", str(self.traces)]
        if self.max_tokens:
            parts += ["--max-trace-tokens", str(self.max_tokens)]
        return shlex.join([*parts, "--out", str(self.out)])


def _sequences(settings: CentersSettings, tokenizer) -> list[list[int]]:
    if settings.text is not None:
        ids = tokenizer(settings.text.read_text(encoding="utf-8"))["input_ids"]
        ids = list(ids[: settings.max_tokens] if settings.max_tokens else ids)
        if not ids:
            raise ValueError(f"--text {str(settings.text)!r} holds no tokens")
        return [ids]
    problems = [p for p in load_dataset(settings.dataset) if p.solution][: settings.traces]
    if not problems:
        raise ValueError(f"dataset {settings.dataset!r} has no reference solutions; pass --text FILE")
    traces = [reference_trace(tokenizer, p) for p in problems]
    return [t.ids[: settings.max_tokens] if settings.max_tokens else t.ids for t in traces]


@torch.inference_mode()
def compute_centers(model, sequences: list[list[int]], *, name: str = "", source: str = "") -> QueryCenters:
    """The query centers of ``model`` over ``sequences`` (token id lists), every token's query counted once."""
    info = model_info(model)
    layers = info.full_layers
    device = next(model.parameters()).device
    tables = {layer: info.rotary_of(layer, "calibrate --centers").tables(device) for layer in layers}
    sums = CenterSums(1, layers, info.num_heads, info.head_dim // 2, device)
    current: dict[str, torch.Tensor] = {}

    def listen(layer, query, key, mask, kwargs) -> None:
        if layer in tables:
            sums.add(layer, query, current["positions"], current["valid"], tables[layer])

    tap = AttentionTap(model, listen)
    try:
        for ids in sequences:
            current["positions"] = torch.arange(len(ids), device=device).unsqueeze(0)
            current["valid"] = torch.ones(1, len(ids), dtype=torch.bool, device=device)
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    finally:
        tap.close()
    mean, modulus = sums.means()
    return QueryCenters(
        mean=mean[0].cpu(),
        modulus=modulus[0].cpu(),
        layers=layers,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        head_dim=info.head_dim,
        model=name,
        fingerprint=info.fingerprint,
        tokens=int(sums.count[0, 0]),
        source=source,
    )


def run_centers(settings: CentersSettings) -> int:
    """Compute and write the query centers ``settings`` describe; returns 0."""
    print(f"loading {settings.model} ({settings.dtype}, {settings.device}, {settings.attn}) ...", file=sys.stderr)
    model, tokenizer = load_model(
        settings.model, dtype=settings.dtype, device=settings.device, attn_implementation=settings.attn
    )
    sequences = _sequences(settings, tokenizer)
    centers = compute_centers(model, sequences, name=settings.model, source=settings.source)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    centers.save(settings.out)
    print(
        f"calibrate --centers: {centers.tokens} queries per head from {len(sequences)} sequences "
        f"({settings.source}); wrote {settings.out}",
        file=sys.stderr,
    )
    return 0
