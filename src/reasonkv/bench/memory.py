"""Memory accounting for the benchmark: exact KV bytes, weights, peak readers, the max-batch model.

KV bytes are computed (exact formulas), peak memory is measured: on CUDA the allocator's
``max_memory_allocated``, on CPU the kernel's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``), an approximation that also counts memory the C allocator keeps after a free.
:class:`MemoryModel` turns two measured batch sizes into ``fixed + batch x per_row`` and answers how many rows
fit in a limit.
"""

from __future__ import annotations

import math
import os
import re
import resource
from dataclasses import asdict, dataclass

import torch

from reasonkv.hf import model_info, sliding_window

__all__ = [
    "MemoryModel",
    "PeakTracker",
    "format_bytes",
    "held_bytes",
    "kv_bytes_per_token",
    "machine_memory_bytes",
    "parse_bytes",
    "rss_bytes",
    "weight_bytes",
    "window_kv_bytes",
]

_UNITS = {"": 1, "b": 1} | {  # k, kb: 1000; kib: 1024; and so on up to t
    prefix + suffix: base**power
    for power, prefix in enumerate("kmgt", 1)
    for suffix, base in (("", 1000), ("b", 1000), ("ib", 1024))
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"48GB"``, ``"512MiB"``, ``"1.5TiB"``, ``"1000000"`` -> bytes.

    ``K``/``M``/``G``/``T`` and ``KB``/``MB``/... are powers of 1000, ``KiB``/``MiB``/... powers of 1024.
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"memory size {text!r} is not a number with a unit like 24GiB, 48GB or 512MiB")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"memory size {text!r} must be positive")
    return int(value)


def format_bytes(value: float | None) -> str:
    """Bytes as MiB below 1 GiB, GiB above (``"-"`` for None)."""
    if value is None:
        return "-"
    if abs(value) < 1024**3:
        return f"{value / 1024**2:.1f} MiB"
    return f"{value / 1024**3:.2f} GiB"


def format_small_bytes(value: float | None) -> str:
    """Bytes as KiB below 1 MiB (a small model's cache), else as :func:`format_bytes`."""
    if value is not None and abs(value) < 1024**2:
        return f"{value / 1024:.1f} KiB"
    return format_bytes(value)


def held_bytes(window: dict) -> int:
    """K/V bytes a measured window held: the full-precision slots in use, the quantized tier, the sliding window
    (``kv_bytes`` is the allocated capacity, which storage grows ahead of use)."""
    if "kv_bytes_used" not in window:
        return window["kv_bytes"]
    return window["kv_bytes_used"] + window.get("kv_bytes_quantized", 0) + window.get("kv_bytes_sliding", 0)


def kv_bytes_per_token(model_or_config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies in one row's full-attention layers:
    ``full layers x 2 x kv_heads x head_dim x size`` (every layer of a plain model)."""
    info = model_info(model_or_config)
    size = torch.empty((), dtype=dtype).element_size()
    return len(info.full_layers) * 2 * info.num_kv_heads * info.head_dim * size


def window_kv_bytes(model_or_config, dtype: torch.dtype) -> int:
    """Bytes of K and V one row's sliding-window layers hold once their window is full:
    ``sliding layers x 2 x kv_heads x head_dim x size x (window - 1)`` (0 without sliding layers)."""
    info = model_info(model_or_config)
    sliding = sum(kind == "sliding" for kind in info.layer_kinds)
    if not sliding:
        return 0
    size = torch.empty((), dtype=dtype).element_size()
    return sliding * 2 * info.num_kv_heads * info.head_dim * size * (sliding_window(model_or_config) - 1)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "meta":
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total


def rss_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc``; elsewhere the peak from ``getrusage``)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024


def _proc_bytes(path: str, field: str) -> int | None:
    """The ``field:`` line of a Linux ``/proc`` file (kB there) in bytes, or None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as lines:
            for line in lines:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class PeakTracker:
    """Peak memory since the last :meth:`reset`: CUDA max allocated, or the CPU's peak resident set."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cpu_resettable: bool | None = None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if self._cpu_resettable is False:
            return
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")  # resets VmHWM to the current resident set
            self._cpu_resettable = True
        except OSError:
            self._cpu_resettable = False

    def peak(self) -> int | None:
        """Peak bytes since the last reset (None on a CPU whose peak cannot be reset)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if not self._cpu_resettable:
            return None
        return _proc_bytes("/proc/self/status", "VmHWM")

    def current(self) -> int:
        """Bytes in use now: CUDA allocated, or the resident set."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return rss_bytes()


def machine_memory_bytes(device: torch.device) -> int:
    """Memory this process could use on ``device``: the GPU's total, or available RAM plus our own RSS."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(min(total, free + torch.cuda.memory_reserved(device)))
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    return int(available + rss_bytes())


@dataclass(frozen=True)
class MemoryModel:
    """Memory needed by ``batch`` rows: ``fixed`` (weights, buffers that do not grow with rows) ``+ batch x
    (kv_row + other_row)``: the K/V bytes of a row (exact formula) and the rest that grows with the batch
    (activations, recorded signals, policy state)."""

    fixed: float
    kv_row: float
    other_row: float

    @property
    def per_row(self) -> float:
        return self.kv_row + self.other_row

    def required(self, batch: int) -> float:
        return self.fixed + batch * self.per_row

    def max_batch(self, limit: float) -> int:
        """The largest batch with ``required(batch) <= limit`` (0 if not even one row fits)."""
        if self.per_row <= 0:
            raise ValueError(f"per-row memory must be positive, got {self.per_row}")
        batch = max(0, math.floor((limit - self.fixed) / self.per_row))
        while self.required(batch + 1) <= limit:  # guard against rounding either way
            batch += 1
        while batch > 0 and self.required(batch) > limit:
            batch -= 1
        return batch

    @classmethod
    def fit(cls, probes: list[dict], kv_row: float) -> MemoryModel:
        """Fit from probes ``{"batch", "peak_bytes", "kv_bytes"}`` at two or more batch sizes: each peak less the
        K/V bytes the cache allocated, its slope over the batch ``other_row``, its intercept ``fixed``."""
        points = sorted((int(p["batch"]), float(p["peak_bytes"]) - float(p["kv_bytes"])) for p in probes)
        if len({b for b, _ in points}) < 2:
            raise ValueError("the memory model needs probes at two different batch sizes")
        (b1, m1), (b2, m2) = points[0], points[-1]
        other_row = max(0.0, (m2 - m1) / (b2 - b1))
        return cls(fixed=m1 - b1 * other_row, kv_row=float(kv_row), other_row=other_row)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "per_row": self.per_row}
