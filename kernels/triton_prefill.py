"""Triton variable-length causal prefill attention over a paged prefix plus the new (packed) tokens.

Owns `prefill_attention` (same contract as `kernels.reference.prefill_attention`). One program
handles (query tile of BLOCK_M new tokens, sequence, query head) in two phases that feed one
online softmax:
  1. the cached prefix, positions [0, prefix), read from the paged cache and dequantized on load;
     every new token sees the whole prefix (within its sliding window, if any), so no causal mask;
  2. the new tokens themselves, read from the packed key/value tensors (not from the cache: the
     reference uses them unquantized too), causally masked and stopped at the tile's last row.
Sequence boundaries come from query_start_loc, so no padding is ever computed on. Under a sliding
window a query at position p sees keys in (p - window, p]; each phase starts at the first key the
tile's first row can see, so a long prompt costs O(tokens x window).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    LOG2E,
    cast_to,
    check_cache,
    check_heads,
    dot_dtype,
    load_paged_tile,
    next_pow2,
    on_gpu,
    online_softmax_step,
    scale_args,
    window_arg,
)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, scale_ptr, bt_ptr, qsl_ptr, lens_ptr, out_ptr,
    qk_scale_log2, block_size, window,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
    stride_sb, stride_skv, stride_ss, stride_sh,
    stride_btb, stride_btm,
    stride_ot, stride_oh, stride_od,
    G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:  # the grid is sized for the longest chunk; shorter ones have idle tiles
        prefix = tl.load(lens_ptr + seq).to(tl.int32) - q_len
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        tok = (q_start + rows).to(tl.int64)  # packed row index of each query

        q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        q = q.to(tl.float32).to(DOT_DTYPE)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # Phase 1: the cached prefix, from the first key the tile's first row's window reaches.
        bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
        for t0 in range(tl.maximum(prefix + m0 - window + 1, 0), prefix, BLOCK_N):
            toks = t0 + tl.arange(0, BLOCK_N)
            tmask = toks < prefix
            k = load_paged_tile(cache_ptr, scale_ptr, bt_row, toks, tmask, offs_d, dmask, kvh, 0,
                                block_size, stride_btm, stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
                                stride_sb, stride_skv, stride_ss, stride_sh, QUANT)
            v = load_paged_tile(cache_ptr, scale_ptr, bt_row, toks, tmask, offs_d, dmask, kvh, 1,
                                block_size, stride_btm, stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
                                stride_sb, stride_skv, stride_ss, stride_sh, QUANT)
            visible = tmask[None, :] & rmask[:, None] & (toks[None, :] > prefix + rows[:, None] - window)
            m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE)

        # Phase 2: the new tokens, causal. Keys past this tile's last row are invisible to all of it.
        kv_end = tl.minimum(q_len, m0 + BLOCK_M)
        for j0 in range(tl.maximum(m0 - window + 1, 0), kv_end, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            cmask = cols < kv_end
            ctok = (q_start + cols).to(tl.int64)
            kv_mask = cmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + ctok[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + ctok[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0).to(tl.float32)
            visible = cmask[None, :] & (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - window)
            m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE)

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
                 cast_to(out, out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def _tiles(query: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). 128 x 64 with 8 warps is the usual Hopper/Ampere sweet spot for
    16-bit inputs at head_dim <= 128; fp32 operands and 256-wide heads use 64 x 32 to stay within
    shared memory (fp32 128 x 64 needs ~160 KB). The interpreter gets small tiles so the masked
    waste of numpy ops on short test sequences stays low."""
    if not on_gpu(query):
        return 32, 32, 4
    if head_dim > 128 or query.dtype == torch.float32:
        return 64, 32, 4
    return 128, 64, 8


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.reference.prefill_attention`; returns a contiguous [T, H, D].

    One host sync: the longest chunk (from query_start_loc) sizes the grid. Prefill steps are not
    graph-captured, and sizing by T instead would launch B times too many programs.
    """
    quant = check_cache(kv_cache, kv_scale)
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"query must be [T, H, D] and key/value [T, Hkv, D]; got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or tuple(kv_cache.shape[3:]) != (kv_heads, head_dim):
        raise ValueError(
            f"shape mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, cache {tuple(kv_cache.shape)}"
        )
    group = check_heads(num_heads, kv_heads)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    query_start_loc = query_start_loc.to(query.device)
    seq_lens = seq_lens.to(query.device)
    block_tables = block_tables.to(query.device)
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_q_len == 0:
        return out
    block_m, block_n, warps = _tiles(query, head_dim)
    scale_t, *scale_strides = scale_args(kv_cache, kv_scale)
    grid = (triton.cdiv(max_q_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        query, key, value, kv_cache, scale_t, block_tables, query_start_loc, seq_lens, out,
        float(scale) * LOG2E, kv_cache.shape[2], window_arg(window),
        *query.stride(), *key.stride(), *value.stride(), *kv_cache.stride(), *scale_strides,
        *block_tables.stride(), *out.stride(),
        G=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim),
        QUANT=quant, DOT_DTYPE=dot_dtype(query), num_warps=warps, num_stages=2,
    )
    return out
