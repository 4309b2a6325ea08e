"""A CPU model's weights — and its KV caches (`zeros`) — in blocks of anonymous memory backed by 2 MiB pages
(transparent huge pages).

Why: a decode step of a few tokens streams every weight once, and its speed is how fast the weights read.
Straight from safetensors, the weights live in a private mapping of the checkpoint file: 4 KiB page-cache
pages, one TLB miss per 4 KiB of stream — inside a VM a two-level page walk each. Copied here (one
anonymous mapping, 2 MiB-aligned, `madvise(MADV_HUGEPAGE)` before the first touch) a 2 MiB page covers
512 of them. Measured on the 55M Llama, one row, 2 threads (docs/PERFORMANCE.md, session 29): its 57
products 1.09-1.14x faster (both layouts interleaved in one C harness, medians of 60); the batch-1 engine
step 13.1 -> 12.2 ms (weights swapped in place, median of six pairs). The kernel only advises: where THP
is "never" the copy is plain anonymous memory, which reads as fast as the file mapping did.

The cost: weights are now each process's own memory, not page cache that two workers on one box loading
one checkpoint shared (only the fused q/k/v and gate/up were private before) — as in vLLM, which copies too.

The KV caches (`zeros`: every engine's cache, a draft model's or EAGLE head's own) are read the same way by
decode attention, a strided walk over scattered blocks: in huge pages its kernel ran 5-20% faster (session 30).
They are zero-filled at once, so every page is committed at start-up as `torch.zeros` committed it.

The tensors returned are views of the block; the block lives as long as any of them does.
"""

from __future__ import annotations

import math
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor starts on its own page: a weight's rows never share a page with another weight


def hugepage_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` uint8 of fresh anonymous memory starting on a 2 MiB boundary, advised to huge pages. The
    mapping is whole huge pages plus one, so the aligned range inside it is whole huge pages too (a block of
    under 2 MiB would otherwise hold no huge page at all)."""
    whole = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    block = mmap.mmap(-1, whole + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere plain anonymous memory
        block.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(block, dtype=torch.uint8)  # holds `block` alive for as long as a view exists
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


def allocate(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of the given shapes and dtypes, side by side in one huge-page block (each
    starting on its own 4 KiB page). The loader fills them straight from the checkpoint, so the only
    anonymous copy of a weight is the one served (a bf16 checkpoint served in fp32 widens into place)."""
    sizes = {name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
             for name, (shape, dtype) in specs.items()}
    block = hugepage_empty(max(1, sum(-(-n // ALIGN) * ALIGN for n in sizes.values())))
    offset, views = 0, {}
    for name, (shape, dtype) in specs.items():
        views[name] = block[offset:offset + sizes[name]].view(dtype).view(shape)
        offset += -(-sizes[name] // ALIGN) * ALIGN
    return views


def zeros(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device | str = "cpu"
          ) -> dict[str, torch.Tensor]:
    """Zero-filled tensors of the given shapes and dtypes; on a CPU side by side in one huge-page block (the KV
    caches: decode attention reads a sequence's blocks scattered over all of a cache) with every page written
    now, so the memory is committed at start-up as torch.zeros commits it. Elsewhere plain torch.zeros."""
    if torch.device(device).type != "cpu":
        return {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in specs.items()}
    return {name: t.zero_() for name, t in allocate(specs).items()}


_SHARED_BLOCK = 32 << 20
_shared: list = [None, 0]  # the block small copies are carved from now, and the next free offset in it
_shared_lock = threading.Lock()


def copy_into_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in huge pages: carved from a shared 32 MiB block (one past that size
    gets its own), for the copies made after loading — the bf16 copy of a weight served in fp32 that a decode
    step streams (tandem/layers/linear.py). A block is freed when the last tensor carved from it is (plus the
    one blocks are being carved from now, at most 32 MiB)."""
    nbytes = t.numel() * t.element_size()
    size = -(-max(nbytes, 1) // ALIGN) * ALIGN
    with _shared_lock:
        if size > _SHARED_BLOCK:
            block, offset = hugepage_empty(size), 0
        else:
            block, offset = _shared
            if block is None or offset + size > block.numel():
                block, offset = hugepage_empty(_SHARED_BLOCK), 0
            _shared[:] = [block, offset + size]
    out = block[offset:offset + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
