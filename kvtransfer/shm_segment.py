"""The shared-memory segment behind the `shm` connector: D's per-layer KV caches (and scales) as views
of one /dev/shm file, pre-faulted once at start-up and mapped for the worker's lifetime; P maps the same
file by the path the handshake gives it. Owns the file's layout (page-aligned per-layer offsets), its
removal (close, normal exit, or the next allocation reaping a dead owner's files) and the lookup from a
cache tensor back to its segment.
"""

from __future__ import annotations

import os
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.base import CacheLayout

SHM_DIR = "/dev/shm"
FILE_PREFIX = "tandem-kv-"
ALIGN = 4096  # each layer's tensor starts on a page


@dataclass(slots=True)
class SharedKVHandle:
    """A shared-memory KV cache segment; close() (or a normal interpreter exit) removes the file.
    Mapped tensors stay valid after close(); only new senders can no longer attach. A process that
    dies without either leaves /dev/shm/tandem-kv-<pid>-* behind."""

    path: str
    nbytes: int
    num_blocks: int
    layer_offsets: list[int]
    scale_offsets: list[int] | None
    buffer: torch.Tensor = field(repr=False)  # the whole mapping, uint8
    _finalizer: Any = field(default=None, repr=False)

    def close(self) -> None:
        SEGMENTS.pop(self.buffer.data_ptr(), None)
        if self._finalizer is not None:
            self._finalizer()


SEGMENTS: dict[int, SharedKVHandle] = {}  # base address of the mapping -> handle


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def plan(layout: CacheLayout, num_blocks: int) -> tuple[list[int], list[int] | None, int]:
    """Byte offsets of each layer's cache (and scale) tensor in the segment, and its total size."""
    def aligned(n: int) -> int:
        return (n + ALIGN - 1) // ALIGN * ALIGN
    cache_bytes, scale_bytes = num_blocks * layout.block_nbytes, num_blocks * layout.scale_block_nbytes
    layer_offsets = [i * aligned(cache_bytes) for i in range(layout.num_layers)]
    end = layout.num_layers * aligned(cache_bytes)
    scale_offsets = None
    if layout.is_quantized:
        scale_offsets = [end + i * aligned(scale_bytes) for i in range(layout.num_layers)]
        end += layout.num_layers * aligned(scale_bytes)
    return layer_offsets, scale_offsets, end


def views(buffer: torch.Tensor, layout: CacheLayout, num_blocks: int, layer_offsets: list[int],
           scale_offsets: list[int] | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    cache_bytes, scale_bytes = num_blocks * layout.block_nbytes, num_blocks * layout.scale_block_nbytes
    if any(o < 0 or o % ALIGN or o + cache_bytes > buffer.numel() for o in layer_offsets) or any(
            o < 0 or o % ALIGN or o + scale_bytes > buffer.numel() for o in scale_offsets or []):
        raise ValueError("shared KV segment offsets fall outside the segment")
    caches = [buffer[o:o + cache_bytes].view(layout.torch_kv_dtype).view(num_blocks, *layout.block_shape)
              for o in layer_offsets]
    scales = None if scale_offsets is None else [
        buffer[o:o + scale_bytes].view(torch.float32).view(num_blocks, *layout.scale_block_shape)
        for o in scale_offsets]
    return caches, scales


def reap_orphaned_segments(directory: str = SHM_DIR) -> list[str]:
    """Remove segments whose owner (the pid in the name) is gone: a decode worker killed with
    SIGKILL cannot remove its own. Run at every allocation, so a restarted worker cleans up after the
    one it replaces. (Each container has its own /dev/shm, so pids are of this pid namespace.)"""
    reaped = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if not name.startswith(FILE_PREFIX):
            continue
        pid = name[len(FILE_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _unlink(os.path.join(directory, name))
            reaped.append(name)
        except PermissionError:
            pass  # alive, someone else's
    return reaped


def allocate_shared_kv_caches(
    layout: CacheLayout, num_blocks: int, directory: str = SHM_DIR
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, SharedKVHandle]:
    """D's per-layer caches (and scales) as views of one pre-faulted shared-memory file."""
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
    if not os.path.isdir(directory):
        raise ValueError(f"shared-memory directory {directory!r} does not exist (Linux: /dev/shm)")
    reap_orphaned_segments(directory)
    layer_offsets, scale_offsets, total = plan(layout, num_blocks)
    path = os.path.join(directory, f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    buffer.zero_()  # pre-fault every page now rather than inside the first transfers
    handle = SharedKVHandle(path, total, num_blocks, layer_offsets, scale_offsets, buffer)
    handle._finalizer = weakref.finalize(buffer, _unlink, path)  # also runs at interpreter exit
    SEGMENTS[buffer.data_ptr()] = handle
    caches, scales = views(buffer, layout, num_blocks, layer_offsets, scale_offsets)
    return caches, scales, handle
