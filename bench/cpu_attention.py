"""CPU paged decode attention (kernels/csrc/paged_decode_cpu.c) against the memory's read limit and the torch
reference op, measured in the same run.

A decode step of many long sequences reads every layer's K/V once: past the L3, its speed is how fast the
blocks come in. Each shape below gets one cache per layer (8, rotating, as a model's layers follow each other,
so no layer finds its blocks still cached), blocks scattered as the allocator hands them out; printed: the C
kernel's time per layer, the K/V GB/s it reads against the read limit (bench/peer_vllm.py read_gbps, measured
here), and the torch reference (gather + SDPA) over the same caches. Before timing, each shape's output is
checked against the reference, so a fast wrong kernel cannot post a number.

    python bench/cpu_attention.py [--threads 2] [--layers 8] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.peer_vllm import read_gbps  # noqa: E402
from kernels import native_cpu, reference  # noqa: E402

# (sequences, query rows each, heads, KV heads, head dim, context): the 55M benchmark Llama's heads (8 / 2 x 64)
# and the shipped model's (8 / 4 x 32) at batch 1, a verification of 5 rows, and batches of long contexts.
SHAPES = [(1, 1, 8, 2, 64, 2000), (1, 5, 8, 4, 32, 350), (4, 1, 8, 4, 32, 700), (8, 1, 8, 2, 64, 2000),
          (16, 1, 8, 2, 64, 2000), (16, 1, 8, 4, 32, 2000), (64, 1, 8, 2, 64, 400), (8, 1, 32, 8, 128, 1000)]
BLOCK = 16


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if native_cpu.library() is None:
        sys.exit("the native CPU kernels did not build here (no C compiler?): nothing to measure")
    limit = read_gbps()
    print(f"threads={a.threads} layers={a.layers} read limit {limit:.1f} GB/s")
    print(f"{'B':>3} {'Q':>2} {'H/Hkv x D':>12} {'ctx':>5} {'KV/layer':>9} {'C ms/layer':>11} {'GB/s':>6} "
          f"{'of limit':>8} {'ref ms/layer':>13} {'ref / C':>8}")
    g = torch.Generator().manual_seed(0)
    for b, q, h, hkv, d, ctx in SHAPES:
        per = -(-ctx // BLOCK)
        num_blocks = b * per + 8
        caches = [torch.randn(num_blocks, 2, BLOCK, hkv, d, generator=g) for _ in range(a.layers)]
        tables = torch.randperm(num_blocks, generator=g)[:b * per].view(b, per).int().contiguous()
        query = torch.randn(b, q, h, d, generator=g)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        scale = d ** -0.5
        got = native_cpu.paged_decode_attention(query, caches[0], tables, lens, scale)
        want = reference.paged_decode_attention(query, caches[0], tables, lens, scale)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

        def run(op):
            for cache in caches:
                op(query, cache, tables, lens, scale)

        c_ms = median_ms(lambda: run(native_cpu.paged_decode_attention), a.reps) / a.layers
        ref_ms = median_ms(lambda: run(reference.paged_decode_attention), max(3, a.reps // 4)) / a.layers
        kv_bytes = b * ctx * hkv * d * 2 * 4
        gbs = kv_bytes / c_ms / 1e6
        print(f"{b:>3} {q:>2} {f'{h}/{hkv} x {d}':>12} {ctx:>5} {kv_bytes / 2**20:>7.1f}Mi {c_ms:>11.3f} {gbs:>6.1f} "
              f"{gbs / limit:>8.0%} {ref_ms:>13.3f} {ref_ms / c_ms:>7.1f}x")


if __name__ == "__main__":
    main()
