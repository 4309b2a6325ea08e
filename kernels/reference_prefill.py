"""Prefill attention for the torch reference path: a chunk of new tokens per sequence over its paged
prefix plus itself, causal — or within a sliding window.

Full causal attention runs through CPU flash kernels (no explicit mask: a mask sends SDPA down its
slow math path). Under a sliding window a query at position p sees the keys in (p - window, p]
(transformers' `sliding_window_overlay`: `kv_idx > q_idx - sliding_window`); the queries are then
taken in tiles so each tile attends only the keys its window can reach: the work is
O(tokens x window), and a prompt many windows long never materialises a [tokens, tokens] mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference_cache import _gather_tokens


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
    """Causal attention for a chunk of new tokens per sequence over its cached prefix plus itself.

    query [T, H, D], key/value [T, Hkv, D]: the new tokens of all sequences, packed; sequence i owns
    rows query_start_loc[i]:query_start_loc[i+1] (query_start_loc [B+1] int32). Its first
    seq_lens[i] - q_len_i tokens are read from the paged cache (prefix hits, earlier chunks); its new
    tokens attend to that prefix and causally to each other — within the last `window` positions
    when a sliding window is given (prefix blocks wholly before every query's window are not read).
    Returns [T, H, D] in query's dtype.
    """
    out = torch.empty_like(query)
    h = query.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    bs = kv_cache.shape[2]
    for i in range(len(lens)):
        s, e = starts[i], starts[i + 1]
        q_len = e - s
        if q_len == 0:
            continue
        prefix = lens[i] - q_len
        k, v = key[s:e], value[s:e]
        if window is not None and lens[i] > window:  # the window binds for some query of this chunk
            first = max(0, prefix - window + 1)  # the earliest key the chunk's first query sees
            fb = first // bs
            if prefix > first:
                pk, pv = _gather_tokens(kv_cache, kv_scale, block_tables[i, fb:(prefix + bs - 1) // bs].long(),
                                        query.dtype)
                k = torch.cat([pk[first - fb * bs:prefix - fb * bs], k.to(query.dtype)])
                v = torch.cat([pv[first - fb * bs:prefix - fb * bs], v.to(query.dtype)])
            out[s:e] = sliding_window_attention(query[s:e], k, v, prefix, first, window, scale)
            continue
        if prefix > 0:
            n_blocks = (prefix + bs - 1) // bs
            pk, pv = _gather_tokens(kv_cache, kv_scale, block_tables[i, :n_blocks].long(), query.dtype)
            o = _prefix_then_causal(query[s:e].transpose(0, 1), pk[:prefix].transpose(0, 1),
                                    pv[:prefix].transpose(0, 1), k.to(query.dtype).transpose(0, 1),
                                    v.to(query.dtype).transpose(0, 1), scale)
        else:
            # 4-D on purpose: given [H, L, D] SDPA takes its math path on CPU (materialised scores,
            # ~4.7x slower for a 1900-token prompt), given [1, H, L, D] its flash kernel.
            o = F.scaled_dot_product_attention(query[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], scale=scale, is_causal=True,
                                               enable_gqa=h != k.shape[1])[0]
        out[s:e] = o.transpose(0, 1)
    return out


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_then_causal(q, pk, pv, k, v, scale: float) -> torch.Tensor:
    """q [H, L, D] over a fully visible prefix pk/pv [Hkv, P, D] and causally over k/v [Hkv, L, D].

    An explicit [L, P+L] mask sends SDPA down its slow math path (4x slower here); instead the two
    parts run through the CPU flash kernel (no mask, and is_causal) and merge exactly by their
    log-sum-exp. Falls back to one masked SDPA where that kernel is missing or not on CPU."""
    group = q.shape[0] // k.shape[0]
    if _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == torch.float32:
        pk, pv, k, v = (t.repeat_interleave(group, 0) if group > 1 else t for t in (pk, pv, k, v))
        o1, lse1 = _FLASH_CPU(q[None], pk[None], pv[None], 0.0, False, scale=scale)
        o2, lse2 = _FLASH_CPU(q[None], k[None], v[None], 0.0, True, scale=scale)
        m = torch.maximum(lse1, lse2)
        w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
        return ((o1 * w1 + o2 * w2) / (w1 + w2))[0]
    prefix, n = pk.shape[1], q.shape[1]
    mask = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device).tril(prefix)
    return F.scaled_dot_product_attention(q, torch.cat([pk, k], 1), torch.cat([pv, v], 1), attn_mask=mask,
                                          scale=scale, enable_gqa=group > 1)


TILE = 256  # query rows per SDPA call; the mask is [TILE, TILE + window - 1]


def sliding_window_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos0: int,
                             k_pos0: int, window: int, scale: float) -> torch.Tensor:
    """query [L, H, D] at positions q_pos0.., keys/values [K, Hkv, D] at positions k_pos0..
    (k_pos0 <= q_pos0 - window + 1 or 0, and the keys reach the last query). Returns [L, H, D]."""
    n, h, _ = query.shape
    gqa = h != keys.shape[1]
    out = torch.empty_like(query)
    for a in range(0, n, TILE):
        b = min(a + TILE, n)
        lo = max(0, q_pos0 + a - window + 1 - k_pos0)  # first key any row of the tile sees
        hi = q_pos0 + b - k_pos0  # one past the last row's own key
        q_pos = torch.arange(q_pos0 + a, q_pos0 + b, device=query.device).view(-1, 1)
        k_pos = torch.arange(k_pos0 + lo, k_pos0 + hi, device=query.device).view(1, -1)
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        o = F.scaled_dot_product_attention(query[a:b].transpose(0, 1)[None], keys[lo:hi].transpose(0, 1)[None],
                                           values[lo:hi].transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)[0]
        out[a:b] = o.transpose(0, 1)
    return out
