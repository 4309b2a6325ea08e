"""Pieces shared by the Triton kernels: exact rounding helpers, the paged-cache tile loader, the
online-softmax update, and the host-side checks/launch helpers.

Owns the numerics every kernel agrees on:
  * every load is upcast to fp32 before arithmetic (the interpreter's bf16/fp16 math is broken, and
    fp32 accumulation is what the reference's SDPA does anyway);
  * quantized caches are dequantized on load as `q.float() * scale`;
  * downcasts to bf16 / fp8 e4m3 are pre-rounded to the exact target value (round-to-nearest-even)
    in fp32, so the final `.to()` is exact everywhere. The interpreter's own fp32->bf16 cast
    truncates and its fp32->fp8 cast rounds half-up without carrying into the exponent; on GPU the
    pre-rounded value converts exactly, so both paths agree with torch bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import QUANT_MAX

LOG2E = 1.4426950408889634

# torch cache dtypes the kernels accept (quantized ones carry a float32 kv_scale).
SUPPORTED_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
SUPPORTED_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def round_half_even(x):
    """fp32 round-to-nearest-even (torch.round), built from floor so it is exact on every backend."""
    f = tl.floor(x)
    diff = x - f
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (diff > 0.5) | ((diff == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def round_to_e4m3(x):
    """fp32 -> nearest float8_e4m3fn value (as fp32), ties to even, saturating at +-448.

    The spacing of e4m3 values in the binade of |x| is 2**(e - 3) (3 mantissa bits), with e clamped
    at -6 below which values are subnormal with the fixed spacing 2**-9.
    """
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, -6) - 3
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)  # exact power of two
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)  # 1 / ulp, also exact
    r = round_half_even(x * inv_ulp) * ulp  # scaling by powers of two is exact
    r = tl.minimum(tl.maximum(r, -448.0), 448.0)
    # A negative x that rounds to zero is -0 in torch's cast (found on an H100: bench/kernels.py's
    # bit-exact check); floor-based rounding gives +0, so put x's sign bit back.
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """fp32 -> nearest bfloat16 value (as fp32), ties to even (what torch's .to(bfloat16) does)."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) & -65536  # -65536 == 0xFFFF0000 as int32
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """fp32 -> dtype with round-to-nearest-even on every backend (see module docstring)."""
    if dtype == tl.bfloat16:
        x = round_to_bf16(x)
    elif dtype == tl.float8e4nv:
        x = round_to_e4m3(x)
    return x.to(dtype)


@triton.jit
def load_paged_tile(
    cache_ptr, scale_ptr, bt_row_ptr, toks, tmask, offs_d, dmask, kvh, which,
    block_size, stride_bt, stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
    stride_sb, stride_skv, stride_ss, stride_sh,
    QUANT: tl.constexpr,
):
    """Rows `toks` [N] of one sequence's K (which=0) or V (which=1) for KV head `kvh` -> fp32 [N, D].

    Token t lives in physical block bt_row[t // block_size] at offset t % block_size, so a tile may
    span several (non-contiguous) cache blocks; masked rows read nothing and come back as 0.
    """
    blk = tl.load(bt_row_ptr + (toks // block_size) * stride_bt, mask=tmask, other=0).to(tl.int64)
    off = (toks % block_size).to(tl.int64)
    row = blk * stride_cb + which * stride_ckv + off * stride_cs + kvh * stride_ch
    ptrs = cache_ptr + row[:, None] + offs_d[None, :] * stride_cd
    x = tl.load(ptrs, mask=tmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    if QUANT:
        srow = blk * stride_sb + which * stride_skv + off * stride_ss + kvh * stride_sh
        s = tl.load(scale_ptr + srow, mask=tmask, other=0.0)
        x = x * s[:, None]
    return x


@triton.jit
def online_softmax_step(
    q, k, v, visible, m_i, l_i, acc, qk_scale_log2,
    DOT_DTYPE: tl.constexpr,
):
    """One flash-attention step: fold keys k / values v [N, D] (fp32) into the running state.

    q [R, D] is already in DOT_DTYPE. Scores live in the log2 domain (scaled by scale * log2 e) so
    exp2 can be used. `visible` [R, N] masks keys out; a row that has seen no visible key yet keeps
    m = -inf, and the m_safe trick keeps it from producing NaN (exp2(-inf - -inf)).
    DOT_DTYPE is fp32 (exact, and the only safe choice in the interpreter) or the query's 16-bit
    dtype on GPU, where tensor cores want 16-bit operands; the reference rounds dequantized K/V to
    the query dtype too, so this matches it.
    """
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * qk_scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, l_i, acc


# --------------------------------------------------------------------------------------------------
# host helpers

TORCH_TO_TL = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.int8: tl.int8,
    torch.float8_e4m3fn: tl.float8e4nv,
}


# triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set before triton's import.
INTERPRETED = type(round_half_even).__name__ == "InterpretedFunction"
# Set only by kernels/triton_compile_check.py: plan, type and compile kernels as for a GPU while the
# tensors stay on CPU (launches are replaced by ahead-of-time compilation there).
COMPILE_ONLY_SM_COUNT: int | None = None


def on_gpu(t: torch.Tensor) -> bool:
    """Whether kernels for t are planned as GPU kernels (tile sizes, tensor-core dtypes, splits)."""
    return t.device.type == "cuda" or COMPILE_ONLY_SM_COUNT is not None


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's GPU (cached by torch, no sync); 1 when interpreted."""
    if t.device.type == "cuda":
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    return COMPILE_ONLY_SM_COUNT or 1


def check_device(t: torch.Tensor) -> None:
    """Compiled Triton needs CUDA tensors; CPU tensors only work in the (test-only) interpreter."""
    if not on_gpu(t) and not INTERPRETED:
        raise ValueError(
            f"Triton kernels got a {t.device.type} tensor: they need CUDA, or TRITON_INTERPRET=1 set before "
            "triton is imported (tests only). On CPU use TANDEM_KERNELS=reference (the default there)."
        )


def next_pow2(n: int, minimum: int = 16) -> int:
    """Tile sizes are powers of two; tl.dot needs every dimension >= 16 on GPU."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


def dot_dtype(query: torch.Tensor) -> tl.dtype:
    """fp32 in the interpreter (its 16-bit math is broken) and for fp32 inputs; else the query dtype."""
    if not on_gpu(query) or query.dtype == torch.float32:
        return tl.float32
    return TORCH_TO_TL[query.dtype]


def check_cache(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """Validate the cache / scale pair; returns True when the cache is quantized."""
    check_device(kv_cache)
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in SUPPORTED_CACHE_DTYPES:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} is not supported; use one of {SUPPORTED_CACHE_DTYPES}")
    if kv_cache.dtype == torch.float8_e4m3fn and kv_cache.is_cuda:
        major, minor = torch.cuda.get_device_capability(kv_cache.device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"float8_e4m3fn KV caches need compute capability >= 8.9 for Triton's fp8 conversions; this GPU "
                f"is {major}.{minor}. Use an int8 KV cache (or the reference ops) here."
            )
    quant = kv_cache.dtype in QUANT_MAX
    if quant:
        if kv_scale is None:
            raise ValueError(f"a {kv_cache.dtype} cache needs kv_scale [num_blocks, 2, block_size, num_kv_heads]")
        if kv_scale.shape != kv_cache.shape[:4] or kv_scale.dtype != torch.float32:
            raise ValueError(
                f"kv_scale must be float32 {tuple(kv_cache.shape[:4])}, got {kv_scale.dtype} {tuple(kv_scale.shape)}"
            )
    return quant


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head (GQA group size); any integer ratio is accepted."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def scale_args(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> tuple:
    """(scale tensor, its 4 strides); the cache itself stands in as a never-read dummy when unquantized."""
    if kv_scale is None:
        return (kv_cache, 0, 0, 0, 0)
    return (kv_scale, *kv_scale.stride())


NO_WINDOW = 1 << 30  # a window no context reaches: full causal attention, with no branch in the kernels


def window_arg(window: int | None) -> int:
    """The kernels' `window` argument: a query at position p sees keys in (p - window, p]."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return NO_WINDOW if window is None else int(window)
