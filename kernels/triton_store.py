"""Triton `store_kv`: write new K/V rows into the paged cache by slot, quantizing on the way in.

Owns the write side of the cache layout. One program per token writes all of that token's KV heads
for both K and V (one [Hkv, D] tile each), so a quantized row's absmax, scale and rounded values
come from one pass over registers. Quantization is bit-identical to `reference.quantize_rows`:
scale = max(absmax, 1e-8) / qmax, value / scale with IEEE division (`div_rn`; Triton's default fp32
division is approximate on GPU and could flip a rounding), then round-half-even (int8) or
round-to-nearest-even into e4m3 (fp8). Slot -1 rows are skipped (padding in a CUDA-graph batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import QUANT_MAX
from kernels.triton_common import cast_to, check_cache, next_pow2, round_half_even, round_to_e4m3, scale_args


@triton.jit
def _store_one(
    x_ptr, stride_xt, stride_xh, stride_xd, t,
    cache_ptr, scale_ptr, cache_row, scale_row, stride_ckv, stride_ch, stride_cd, stride_skv, stride_sh,
    which, offs_h, offs_d, hmask, dmask,
    QUANT: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr,
):
    """Store K (which=0) or V (which=1) of token t: x[t] is [Hkv, D]."""
    mask = hmask[:, None] & dmask[None, :]
    x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd,
                mask=mask, other=0.0).to(tl.float32)
    dst = cache_ptr + cache_row + which * stride_ckv + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    if QUANT:
        absmax = tl.max(tl.abs(x), 1)
        scale = tl.div_rn(tl.maximum(absmax, 1e-8), tl.zeros_like(absmax) + QMAX)
        q = tl.div_rn(x, scale[:, None])
        if IS_INT8:
            q = tl.minimum(tl.maximum(round_half_even(q), -QMAX), QMAX)
        else:
            q = round_to_e4m3(q)  # exact e4m3 value, so the cast below cannot round again
        tl.store(dst, q.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_row + which * stride_skv + offs_h * stride_sh, scale, mask=hmask)
    else:
        tl.store(dst, cast_to(x, cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, scale_ptr, slot_ptr, block_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
    stride_sb, stride_skv, stride_ss, stride_sh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        hmask = offs_h < NUM_KV_HEADS
        dmask = offs_d < HEAD_DIM
        cache_row = blk * stride_cb + off * stride_cs
        scale_row = blk * stride_sb + off * stride_ss
        _store_one(k_ptr, stride_kt, stride_kh, stride_kd, t, cache_ptr, scale_ptr, cache_row, scale_row,
                   stride_ckv, stride_ch, stride_cd, stride_skv, stride_sh, 0, offs_h, offs_d, hmask, dmask,
                   QUANT, IS_INT8, QMAX)
        _store_one(v_ptr, stride_vt, stride_vh, stride_vd, t, cache_ptr, scale_ptr, cache_row, scale_row,
                   stride_ckv, stride_ch, stride_cd, stride_skv, stride_sh, 1, offs_h, offs_d, hmask, dmask,
                   QUANT, IS_INT8, QMAX)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Same contract as `kernels.reference.store_kv`: key/value [T, Hkv, D] (any strides, any float
    dtype), slot_mapping [T] int32/int64 with -1 = skip. Duplicate slots: one of the rows wins."""
    quant = check_cache(kv_cache, kv_scale)
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    num_tokens, kv_heads, head_dim = key.shape
    if (kv_heads, head_dim) != tuple(kv_cache.shape[3:]):
        raise ValueError(f"rows have (Hkv, D) = {(kv_heads, head_dim)}, the cache {tuple(kv_cache.shape[3:])}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.to(kv_cache.device)
    scale_t, *scale_strides = scale_args(kv_cache, kv_scale)
    block_h = next_pow2(kv_heads, 1)
    block_d = next_pow2(head_dim, 1)
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, scale_t, slot_mapping, kv_cache.shape[2],
        *key.stride(), *value.stride(), *kv_cache.stride(), *scale_strides,
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        QUANT=quant, IS_INT8=kv_cache.dtype == torch.int8, QMAX=QUANT_MAX.get(kv_cache.dtype, 1.0),
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
