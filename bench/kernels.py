"""GPU benchmark of the Triton kernels, each printed as a ratio against a peer measured in the same run.

Owns the kernel numbers quoted in docs/PERFORMANCE.md:
  * paged decode attention (batch 64 x 4k context, GQA 8:1, head dim 128; bf16 and fp8 caches):
    achieved GB/s of cache read vs the device's measured device-to-device copy bandwidth;
  * prefill attention (causal, no prefix): TFLOP/s vs torch scaled_dot_product_attention on the
    same shapes (flash backend for bf16);
  * store_kv and gather/scatter_blocks: GB/s vs copy bandwidth (and vs the torch reference op).
Before timing, each op is checked against kernels/reference.py on a small slice so a fast wrong
kernel cannot post a number. Needs CUDA; exits with a message otherwise.

    python bench/kernels.py [--batch 64 --context 4096 --heads 64 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _bench_ms(fn) -> float:
    """Median time of fn in ms; triton's do_bench flushes L2 between runs, so the cache is really read."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (read + write counted), the practical ceiling of a streaming op."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def _cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    from kernels import reference as ref

    full = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    if dtype in ref.QUANT_MAX:
        return ref.quantize_rows(full, dtype)
    return full.to(dtype), None


def _check(out: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 3e-2) -> None:
    err = (out.float() - expected.float()).abs().max().item()
    if not err <= tol * max(1.0, expected.float().abs().max().item()):
        raise SystemExit(f"{what}: Triton result differs from the reference by {err:.3g}; not benchmarking")


def bench_decode(args, ops, copy_gbs: float, cache_dtype: torch.dtype) -> None:
    from kernels import reference as ref

    b, ctx, bs = args.batch, args.context, args.block_size
    blocks_per_seq = -(-ctx // bs)
    cache, scale = _cache(b * blocks_per_seq, bs, args.kv_heads, args.head_dim, cache_dtype)
    # A shuffled pool: every sequence's blocks are scattered, as after hours of serving.
    tables = torch.randperm(b * blocks_per_seq, device="cuda", dtype=torch.int32).view(b, blocks_per_seq)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(b, 1, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    sm = args.head_dim ** -0.5
    _check(ops.paged_decode_attention(query[:2], cache, tables[:2], lens[:2], sm, scale),
           ref.paged_decode_attention(query[:2], cache, tables[:2], lens[:2], sm, scale), "decode")
    ms = _bench_ms(lambda: ops.paged_decode_attention(query, cache, tables, lens, sm, scale))
    kv_bytes = b * ctx * 2 * args.kv_heads * args.head_dim * cache.element_size()
    scale_bytes = 0 if scale is None else b * ctx * 2 * args.kv_heads * 4
    gbs = (kv_bytes + scale_bytes + 2 * query.numel() * query.element_size()) / ms / 1e6
    print(f"decode  {str(cache_dtype):>22}  B={b} ctx={ctx} H={args.heads}/{args.kv_heads} D={args.head_dim}: "
          f"{ms * 1e3:8.1f} us  {gbs:7.0f} GB/s  = {gbs / copy_gbs:.2f} x copy bandwidth")
    ref_ms = _bench_ms(lambda: ref.paged_decode_attention(query, cache, tables, lens, sm, scale))
    print(f"        reference (gather + SDPA) {ref_ms * 1e3:8.1f} us  -> triton is {ref_ms / ms:.1f} x faster")


def bench_prefill(args, ops) -> None:
    from kernels import reference as ref

    b, seq, h, hkv, d = args.prefill_batch, args.prefill_len, args.heads, args.kv_heads, args.head_dim
    t = b * seq
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    cache = torch.empty(1, 2, args.block_size, hkv, d, device="cuda", dtype=torch.bfloat16)  # no prefix
    tables = torch.zeros(b, 1, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, t + 1, seq, dtype=torch.int32, device="cuda")
    lens = torch.full((b,), seq, dtype=torch.int32, device="cuda")
    sm = d ** -0.5
    _check(ops.prefill_attention(q, k, v, cache, tables, qsl, lens, sm),
           ref.prefill_attention(q, k, v, cache, tables, qsl, lens, sm), "prefill")
    ms = _bench_ms(lambda: ops.prefill_attention(q, k, v, cache, tables, qsl, lens, sm))
    # SDPA on the same problem, batched [B, H, L, D]; the layout change is not timed.
    qb, kb, vb = (x.view(b, seq, -1, d).transpose(1, 2).contiguous() for x in (q, k, v))
    sdpa_ms = _bench_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=sm,
                                                               enable_gqa=True))
    flops = 4 * b * h * seq * seq * d / 2  # QK^T and PV, 2 flops per MAC, half the square is masked
    tf, sdpa_tf = flops / ms / 1e9, flops / sdpa_ms / 1e9
    print(f"prefill bf16 causal B={b} L={seq} H={h}/{hkv} D={d}: {tf:6.1f} TFLOP/s   "
          f"SDPA {sdpa_tf:6.1f} TFLOP/s   ratio {tf / sdpa_tf:.2f}")


def bench_store(args, ops, copy_gbs: float, cache_dtype: torch.dtype) -> None:
    from kernels import reference as ref

    tokens, bs, hkv, d = args.store_tokens, args.block_size, args.kv_heads, args.head_dim
    cache, scale = _cache(-(-tokens // bs) * 2, bs, hkv, d, cache_dtype)
    key = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(cache.shape[0] * bs, device="cuda")[:tokens]
    mine, expect = ([cache.clone(), None if scale is None else scale.clone()] for _ in range(2))
    ops.store_kv(key, value, mine[0], slots, mine[1])
    ref.store_kv(key, value, expect[0], slots, expect[1])
    if not torch.equal(mine[0].view(torch.uint8), expect[0].view(torch.uint8)):
        # Which side is off: the same store through the reference op on the CPU decides.
        cpu = [cache.cpu(), None if scale is None else scale.cpu()]
        ref.store_kv(key.cpu(), value.cpu(), cpu[0], slots.cpu(), cpu[1])
        bits = [t.view(torch.uint8).cpu() for t in (mine[0], expect[0], cpu[0])]
        where = (bits[0] != bits[1]).nonzero()[:4].tolist()
        print(f"store_kv {str(cache_dtype):>21}: Triton differs from the GPU reference in "
              f"{int((bits[0] != bits[1]).sum())} bytes, from the CPU reference in {int((bits[0] != bits[2]).sum())}; "
              f"GPU vs CPU reference: {int((bits[1] != bits[2]).sum())} bytes. First: "
              + "; ".join(f"{i}: triton {int(bits[0][tuple(i)])} gpu-ref {int(bits[1][tuple(i)])} "
                          f"cpu-ref {int(bits[2][tuple(i)])}" for i in where) + " — not timed")
        return
    ms = _bench_ms(lambda: ops.store_kv(key, value, cache, slots, scale))
    nbytes = 2 * key.numel() * (key.element_size() + cache.element_size())  # read K, V rows; write them
    nbytes += 0 if scale is None else 2 * tokens * hkv * 4
    gbs = nbytes / ms / 1e6
    ref_ms = _bench_ms(lambda: ref.store_kv(key, value, cache, slots, scale))
    print(f"store_kv {str(cache_dtype):>21}  T={tokens}: {gbs:7.0f} GB/s = {gbs / copy_gbs:.2f} x copy bandwidth; "
          f"{ref_ms / ms:.1f} x the reference")


def bench_blocks(args, ops, copy_gbs: float) -> None:
    from kernels import reference as ref

    n, bs, hkv, d = args.transfer_blocks, args.block_size, args.kv_heads, args.head_dim
    cache, _ = _cache(2 * n, bs, hkv, d, torch.bfloat16)
    ids = torch.randperm(2 * n, device="cuda")[:n]
    packed = ops.gather_blocks(cache, ids)
    if not torch.equal(packed, ref.gather_blocks(cache, ids)):
        raise SystemExit("gather_blocks: Triton result differs from the reference; not benchmarking")
    nbytes = 2 * packed.numel() * packed.element_size()  # read + write
    for name, fn, ref_fn in (
        ("gather_blocks ", lambda: ops.gather_blocks(cache, ids, out=packed),
         lambda: ref.gather_blocks(cache, ids, out=packed)),
        ("scatter_blocks", lambda: ops.scatter_blocks(cache, ids, packed),
         lambda: ref.scatter_blocks(cache, ids, packed)),
    ):
        ms, ref_ms = _bench_ms(fn), _bench_ms(ref_fn)
        gbs = nbytes / ms / 1e6
        print(f"{name} {n} blocks x {packed[0].numel() * packed.element_size() // 1024} KiB: {gbs:7.0f} GB/s = "
              f"{gbs / copy_gbs:.2f} x copy bandwidth; {ref_ms / ms:.1f} x torch index_select/index_put")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--store-tokens", type=int, default=16384)
    p.add_argument("--transfer-blocks", type=int, default=4096)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU (the Triton kernels only run interpreted on CPU, "
                         "which says nothing about their speed); run it on a GPU machine.")
    from kernels.triton_ops import TRITON_OPS as ops

    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {name}; measured copy bandwidth {copy_gbs:.0f} GB/s")
    cache_dtypes = [torch.bfloat16]
    if torch.cuda.get_device_capability() >= (8, 9):
        cache_dtypes.append(torch.float8_e4m3fn)
    else:
        print("fp8 e4m3 caches need compute capability >= 8.9; skipping the fp8 rows")
    with torch.inference_mode():
        for dt in cache_dtypes:
            bench_decode(args, ops, copy_gbs, dt)
        bench_prefill(args, ops)
        for dt in cache_dtypes:
            bench_store(args, ops, copy_gbs, dt)
        bench_blocks(args, ops, copy_gbs)


if __name__ == "__main__":
    main()
