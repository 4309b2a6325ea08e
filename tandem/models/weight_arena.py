"""A CPU model's weights in one block of anonymous memory backed by 2 MiB pages (transparent huge pages).

Why: a decode step of a few tokens streams every weight once, and its speed is how fast the weights read.
Straight from safetensors, the weights live in a private mapping of the checkpoint file: 4 KiB page-cache
pages, one TLB miss per 4 KiB of stream — inside a VM a two-level page walk each. Copied here (one
anonymous mapping, 2 MiB-aligned, `madvise(MADV_HUGEPAGE)` before the first touch) a 2 MiB page covers
512 of them. Measured on the 55M Llama, one row, 2 threads (docs/PERFORMANCE.md, session 29): its 57
products 11.2-15.4 -> 9.4-10.2 ms in a C harness; the batch-1 engine step 13.1 -> 12.2 ms (median of six
pairs). The kernel only advises: where THP is "never" the copy is plain anonymous memory, which reads as
fast as the file mapping did.

The tensors returned are views of the block; the block lives as long as any of them does.
"""

from __future__ import annotations

import mmap

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


def pack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors (values, shapes, dtypes) copied into one huge-page block; CPU tensors only."""
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes.values())
    if total == 0:
        return dict(tensors)
    block, offset, packed = hugepage_empty(total), 0, {}
    for name, t in tensors.items():
        n = sizes[name]
        view = block[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        packed[name] = view
        offset += -(-n // ALIGN) * ALIGN
    return packed
