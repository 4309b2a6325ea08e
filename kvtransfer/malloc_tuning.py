"""Keep large freed buffers in the process instead of handing them back to the kernel (glibc only).

A KV transfer moves each layer as one multi-MiB buffer: the ZMQ receiver's message, the sender's
packed copy. glibc serves such sizes with a fresh mmap (or trims them off the heap top when freed),
so every buffer is faulted in again page by page: ~1800 minor faults per 16 MiB transfer on each
side, measured on this VM, and ~20% of a zmq-tcp transfer's time. Raising the mmap and trim
thresholds makes glibc reuse the freed heap memory instead; the process then holds its high-water
mark of such buffers (a few layers' worth), as vLLM's recommended tcmalloc does. Other allocators
(musl, an LD_PRELOADed tcmalloc/jemalloc) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this knob on 64-bit
TRIM_THRESHOLD = 1 << 30

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply once per process; False where the allocator is not glibc's or the user tuned it
    (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment win)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
