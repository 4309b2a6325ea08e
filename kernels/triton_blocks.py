"""Triton `gather_blocks` / `scatter_blocks`: move whole cache blocks between a layer's cache and a
contiguous transfer buffer (the KV-transfer send and receive paths).

Owns block copies. A block is treated as an opaque run of bytes: every tensor whose dim 0 is the
block id and whose per-block slice is contiguous works (a [N, 2, bs, Hkv, D] cache of any dtype,
its [N, 2, bs, Hkv] float32 scales, or any other trailing shape), and copies are bit-exact (fp8,
bf16, NaN payloads included). Bytes are moved as int32 words when sizes and strides allow (so a
GPU issues wide, coalesced loads) and as single bytes otherwise. Dim 0 may have any stride, so a
view into a bigger pool works. Block ids are not bounds-checked on the device (that would need a
sync); passing an id >= num_blocks is the caller's bug, as with any raw copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_device

BLOCK = 1024  # words per program: 4 KB, a handful of vectorised loads per thread


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, ids_ptr, words_per_block, stride_src, stride_dst,
    GATHER: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (i, c) copies chunk c of block i: gather reads src[ids[i]] -> dst[i]; scatter the reverse."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    if GATHER:
        src_row = blk * stride_src
        dst_row = i.to(tl.int64) * stride_dst
    else:
        src_row = i.to(tl.int64) * stride_src
        dst_row = blk * stride_dst
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < words_per_block
    tl.store(dst_ptr + dst_row + offs, tl.load(src_ptr + src_row + offs, mask=mask), mask=mask)


def _as_words(t: torch.Tensor, what: str) -> torch.Tensor:
    """View t [N, ...] (N >= 1, non-empty blocks) as [N, W] words: int32 when the per-block byte
    count, the block stride and the base address are all 4-byte aligned, else uint8. Never copies."""
    if t.dim() < 1 or not t[0].is_contiguous():
        raise ValueError(f"{what}: need [N, ...] with each block contiguous, got strides {tuple(t.stride())}")
    as_bytes = t.view(t.shape[0], -1).view(torch.uint8)  # view(), not reshape(): must alias t
    if as_bytes.shape[1] % 4 == 0 and as_bytes.stride(0) % 4 == 0 and as_bytes.data_ptr() % 4 == 0:
        return as_bytes.view(torch.int32)
    return as_bytes


def _copy(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    n = block_ids.shape[0]
    if n == 0 or src.numel() == 0 or dst.numel() == 0:
        return
    src_w, dst_w = _as_words(src, "source"), _as_words(dst, "destination")
    if src_w.dtype != dst_w.dtype:  # one side could not be word-aligned: fall back to bytes on both
        src_w, dst_w = src_w.view(torch.uint8), dst_w.view(torch.uint8)
    words = src_w.shape[1]
    grid = (n, triton.cdiv(words, BLOCK))
    _copy_blocks_kernel[grid](
        src_w, dst_w, block_ids, words, src_w.stride(0), dst_w.stride(0),
        GATHER=gather, BLOCK=BLOCK, num_warps=4,
    )


def _check_ids(block_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    check_device(block_ids.new_empty(0, device=device))
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_ids must be a 1-D int32/int64 tensor, got {block_ids.dtype} {tuple(block_ids.shape)}")
    return block_ids.to(device)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `kernels.reference.gather_blocks`: pack blocks `block_ids` [n] of one layer
    (or of its scale tensor, any trailing shape) into a contiguous [n, ...] buffer, `out` if given
    (it must have kv_cache's dtype and trailing shape, and contiguous blocks)."""
    block_ids = _check_ids(block_ids, kv_cache.device)
    shape = (block_ids.shape[0], *kv_cache.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    elif tuple(out.shape) != shape or out.dtype != kv_cache.dtype:
        raise ValueError(f"out must be {kv_cache.dtype} {shape}, got {out.dtype} {tuple(out.shape)}")
    _copy(kv_cache, out, block_ids, gather=True)
    return out


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Same contract as `kernels.reference.scatter_blocks`: unpack [n, ...] `blocks` into blocks
    `block_ids` [n] of kv_cache. A buffer of another dtype is converted first (torch .to, like the
    reference); same-dtype buffers are copied bit-exactly. Duplicate ids: one of the writes wins."""
    block_ids = _check_ids(block_ids, kv_cache.device)
    if tuple(blocks.shape) != (block_ids.shape[0], *kv_cache.shape[1:]):
        raise ValueError(
            f"blocks must be [{block_ids.shape[0]}, {', '.join(map(str, kv_cache.shape[1:]))}], "
            f"got {tuple(blocks.shape)}"
        )
    blocks = blocks.to(device=kv_cache.device, dtype=kv_cache.dtype).contiguous()
    _copy(blocks, kv_cache, block_ids, gather=False)
