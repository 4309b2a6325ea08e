"""Block copies between a paged cache and a packed buffer (or another cache), for every connector.

Block ids handed out by a block pool are often consecutive, and a slice copy moves a run of
consecutive blocks with one memcpy; fragmented ids fall back to the kernels' gather/scatter ops
(`kernels.get_ops`: Triton on CUDA, torch reference on CPU).
"""

from __future__ import annotations

import torch

from kernels import KernelOps

MAX_SLICE_RUNS = 8  # past this many runs, per-run Python overhead beats one gather/scatter pass


def _streaming_copy():
    """The native streaming copy (dst address, src address, bytes), or None without the native library."""
    from kernels import native_cpu

    lib = native_cpu.library()
    return None if lib is None else lib.tandem_copy_stream


def _plain_cpu(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Both contiguous CPU tensors of one dtype and block shape: a run of blocks is one span of bytes in each."""
    return (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.is_contiguous() and src.is_contiguous() and dst.shape[1:] == src.shape[1:])


def block_runs(dst_ids: list[int], src_ids: list[int]) -> list[tuple[int, int, int]]:
    """(dst_start, src_start, length) for maximal runs where both id lists advance by one."""
    n = len(dst_ids)
    if n and n == len(src_ids) and _consecutive(dst_ids) and _consecutive(src_ids):
        return [(dst_ids[0], src_ids[0], n)]  # the usual case, without a Python loop per block
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst_ids, src_ids):
        if runs:
            d0, s0, n = runs[-1]
            if d == d0 + n and s == s0 + n:
                runs[-1] = (d0, s0, n + 1)
                continue
        runs.append((d, s, 1))
    return runs


def _consecutive(ids: list[int]) -> bool:
    first = ids[0]
    return ids[-1] - first == len(ids) - 1 and ids == list(range(first, first + len(ids)))


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


def gather(ops: KernelOps, cache: torch.Tensor, ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """cache[ids] packed contiguously into `out` (allocated if None)."""
    runs = block_runs(list(range(len(ids))), ids)
    if out is None:
        out = torch.empty((len(ids), *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    if len(runs) <= MAX_SLICE_RUNS:
        for d, s, n in runs:
            out[d:d + n].copy_(cache[s:s + n])
        return out
    if out.device != cache.device:
        out.copy_(ops.gather_blocks(cache, _index(ids, cache.device)))
        return out
    return ops.gather_blocks(cache, _index(ids, cache.device), out=out)


def scatter(ops: KernelOps, cache: torch.Tensor, ids: list[int], packed: torch.Tensor) -> None:
    """Write packed blocks [n, ...] into cache[ids]; packed may live on another device."""
    runs = block_runs(ids, list(range(len(ids))))
    if len(runs) <= MAX_SLICE_RUNS:
        for d, s, n in runs:
            cache[d:d + n].copy_(packed[s:s + n])
        return
    ops.scatter_blocks(cache, _index(ids, cache.device), packed.to(cache.device))


def scatter_parts(ops: KernelOps, cache: torch.Tensor, ids: list[int], parts: list[torch.Tensor]) -> None:
    """Write packed runs (their blocks in `ids` order, one after another) into cache[ids]."""
    start = 0
    for part in parts:
        scatter(ops, cache, ids[start:start + part.shape[0]], part)
        start += part.shape[0]


def copy_blocks(
    ops: KernelOps, dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int],
    staging: torch.Tensor | None = None, streaming: bool = False,
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] with one copy per run, or gather into `staging` + scatter.
    streaming: `dst` is memory this process will not read again (another process's cache): on the CPU
    each run is written with streaming stores (kernels/csrc/store_cpu.c tandem_copy_stream), which skip
    reading the destination into this core's cache first — 1.5x a memcpy of 2 MiB runs here."""
    runs = block_runs(dst_ids, src_ids)
    if len(runs) <= MAX_SLICE_RUNS:
        stream = _streaming_copy() if streaming and _plain_cpu(dst, src) else None
        if stream is not None:  # contiguous: block i starts i blocks' bytes in (no view tensor per run)
            block = dst[0].numel() * dst.element_size()  # not stride(0): a one-block view may have any
            dst_base, src_base = dst.data_ptr(), src.data_ptr()
        for d, s, n in runs:
            if stream is not None:  # raw addresses: the bounds a slice copy would enforce, checked here
                if min(d, s) < 0 or d + n > dst.shape[0] or s + n > src.shape[0]:
                    raise IndexError(f"blocks {d}..{d + n - 1} / {s}..{s + n - 1} outside caches of "
                                     f"{dst.shape[0]} / {src.shape[0]} blocks")
                stream(dst_base + d * block, src_base + s * block, n * block)
            else:
                dst[d:d + n].copy_(src[s:s + n])
        return
    packed = gather(ops, src, src_ids, out=None if staging is None else staging[: len(src_ids)])
    scatter(ops, dst, dst_ids, packed)
