"""Triton paged decode attention (flash-decoding): Q query tokens per sequence against its paged cache.

Owns `paged_decode_attention` (same contract as `kernels.reference.paged_decode_attention`) and the
split-context plan. One program handles (sequence b, KV head, context split): it loads each K/V tile
once and scores it against all G = H / Hkv query heads of that KV head and all Q query tokens at
once, the rows of its score tile being (query token, head in group). That keeps decode at one read
of the cache per KV head, the bound that matters for a bandwidth-bound op. When the grid
B x Hkv alone would leave the GPU idle, the context is split into partitions whose partial
(max, sum, unnormalised output) triples a second kernel merges; with one split the first kernel
writes the output directly and no partials exist.
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
    online_softmax_step,
    scale_args,
    sm_count,
    window_arg,
)

BLOCK_N = 64  # keys per tile: 16 KB of bf16 K at head_dim 128, several cache blocks per tile
MIN_PARTITION = 256  # tokens; shorter splits spend more on the merge than they win in parallelism


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, scale_ptr, bt_ptr, lens_ptr, out_ptr, pacc_ptr, pml_ptr,
    qk_scale_log2, block_size, partition, window,
    stride_qb, stride_qq, stride_qh, stride_qd,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
    stride_sb, stride_skv, stride_ss, stride_sh,
    stride_btb, stride_btm,
    stride_ob, stride_oq, stride_oh, stride_od,
    num_splits, num_heads,
    Q: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr, DIRECT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)

    # Row r of the tile is query token r // G of head kvh * G + r % G.
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < Q * G
    qi = rows // G
    head = kvh * G + rows % G
    pos = seq_len - Q + qi  # absolute position of each row's query token; it sees keys in (pos - window, pos]
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM

    q_rows = b.to(tl.int64) * stride_qb + qi * stride_qq + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd,
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(tl.float32).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)

    start = split * partition
    end = tl.minimum(start + partition, seq_len)
    # Keys before the first query's window are never read (under a sliding window their blocks may
    # be freed); a split wholly before it loops zero times and leaves m = -inf, which the merge drops.
    start = tl.maximum(start, seq_len - Q - window + 1)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        tmask = toks < end
        k = load_paged_tile(cache_ptr, scale_ptr, bt_row, toks, tmask, offs_d, dmask, kvh, 0,
                            block_size, stride_btm, stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
                            stride_sb, stride_skv, stride_ss, stride_sh, QUANT)
        v = load_paged_tile(cache_ptr, scale_ptr, bt_row, toks, tmask, offs_d, dmask, kvh, 1,
                            block_size, stride_btm, stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
                            stride_sb, stride_skv, stride_ss, stride_sh, QUANT)
        visible = tmask[None, :] & (toks[None, :] <= pos[:, None]) & (toks[None, :] > pos[:, None] - window)
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE)

    if DIRECT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_rows = b.to(tl.int64) * stride_ob + qi * stride_oq + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od,
                 cast_to(out, out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    else:
        # Partials are [B, S, Q, H] (+ D for acc), contiguous. Splits past the end of this sequence
        # write nothing; the merge kernel never reads them.
        # A tensor comparison, not a scalar one: triton 3.9's interpreter turns `int1 & scalar-bool`
        # into an int32 mask, which tl.store refuses.
        live = rmask & (rows * 0 + start < seq_len)
        p_rows = ((b.to(tl.int64) * num_splits + split) * Q + qi) * num_heads + head
        tl.store(pacc_ptr + p_rows[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=live[:, None] & dmask[None, :])
        tl.store(pml_ptr + p_rows * 2, m_i, mask=live)
        tl.store(pml_ptr + p_rows * 2 + 1, l_i, mask=live)


@triton.jit
def _merge_kernel(
    pacc_ptr, pml_ptr, lens_ptr, out_ptr, partition,
    stride_ob, stride_oq, stride_oh, stride_od,
    num_splits, num_heads,
    Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[b, q, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the live splits."""
    b = tl.program_id(0)
    qi = tl.program_id(1)
    h = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    n_live = tl.cdiv(seq_len, partition)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    splits = tl.arange(0, BLOCK_S)
    row0 = (b.to(tl.int64) * num_splits * Q + qi) * num_heads + h  # row of split 0
    row_step = Q * num_heads  # rows between consecutive splits

    m_max = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, n_live, BLOCK_S):
        smask = s0 + splits < n_live
        m = tl.load(pml_ptr + (row0 + (s0 + splits) * row_step) * 2, mask=smask, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, 0))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)

    num = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([], tl.float32)
    for s0 in range(0, n_live, BLOCK_S):
        smask = s0 + splits < n_live
        rows = row0 + (s0 + splits) * row_step
        m = tl.load(pml_ptr + rows * 2, mask=smask, other=float("-inf"))
        l_sum = tl.load(pml_ptr + rows * 2 + 1, mask=smask, other=0.0)
        a = tl.load(pacc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)
        w = tl.exp2(m - m_safe)  # 0 for splits that saw no visible key (m = -inf)
        den += tl.sum(w * l_sum, 0)
        num += tl.sum(w[:, None] * a, 0)
    out = num / tl.where(den > 0.0, den, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + qi * stride_oq + h * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, cast_to(out, out_ptr.dtype.element_ty), mask=dmask)


def plan_partition(batch: int, kv_heads: int, max_context: int, sms: int) -> int:
    """Tokens per context split (a multiple of BLOCK_N). Only host-known sizes are used (the block
    table width, not seq_lens), so planning never syncs with the GPU and CUDA graphs stay valid.
    Interpreted (sms = 1) this means one split: splitting only adds work there."""
    target_programs = 4 * sms  # a few waves so stragglers don't dominate
    want = triton.cdiv(target_programs, max(batch * kv_heads, 1))
    splits = max(1, min(want, triton.cdiv(max_context, MIN_PARTITION)))
    per_split = triton.cdiv(max_context, splits)
    return max(BLOCK_N, triton.cdiv(per_split, BLOCK_N) * BLOCK_N)


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    window: int | None = None,
    *,
    partition_tokens: int | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_decode_attention`; returns a contiguous [B, Q, H, D].

    `partition_tokens` (keyword-only, Triton-only) overrides the context split size; it must be a
    positive multiple of 64. Tests use it to exercise the split + merge path.
    """
    quant = check_cache(kv_cache, kv_scale)
    if query.dim() != 4:
        raise ValueError(f"query must be [B, Q, H, D], got {tuple(query.shape)}")
    b, q_len, h, d = query.shape
    _, _, block_size, kv_heads, cache_d = kv_cache.shape
    if cache_d != d:
        raise ValueError(f"query head_dim {d} != cache head_dim {cache_d}")
    group = check_heads(h, kv_heads)
    out = torch.empty((b, q_len, h, d), dtype=query.dtype, device=query.device)
    if b == 0 or q_len == 0:
        return out
    block_tables = block_tables.to(query.device)
    seq_lens = seq_lens.to(query.device)
    max_context = block_tables.shape[1] * block_size
    partition = partition_tokens or plan_partition(b, kv_heads, max_context, sm_count(query))
    if partition <= 0 or partition % BLOCK_N:
        raise ValueError(f"partition_tokens must be a positive multiple of {BLOCK_N}, got {partition}")
    num_splits = max(1, triton.cdiv(max_context, partition))
    direct = num_splits == 1
    if direct:
        pacc = pml = out  # unused dummies
    else:
        pacc = torch.empty((b, num_splits, q_len, h, d), dtype=torch.float32, device=query.device)
        pml = torch.empty((b, num_splits, q_len, h, 2), dtype=torch.float32, device=query.device)
    block_r = next_pow2(q_len * group)
    block_d = next_pow2(d)
    scale_t, *scale_strides = scale_args(kv_cache, kv_scale)
    _decode_kernel[(b, kv_heads, num_splits)](
        query, kv_cache, scale_t, block_tables, seq_lens, out, pacc, pml,
        float(scale) * LOG2E, block_size, partition, window_arg(window),
        *query.stride(), *kv_cache.stride(), *scale_strides,
        *block_tables.stride(), *out.stride(),
        num_splits, h,
        Q=q_len, G=group, HEAD_DIM=d, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        QUANT=quant, DIRECT=direct, DOT_DTYPE=dot_dtype(query),
        num_warps=4 if block_r * block_d <= 64 * 128 else 8,
    )
    if not direct:
        _merge_kernel[(b, q_len, h)](
            pacc, pml, seq_lens, out, partition, *out.stride(), num_splits, h,
            Q=q_len, HEAD_DIM=d, BLOCK_S=min(next_pow2(num_splits, 1), 16), BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
        )
    return out
