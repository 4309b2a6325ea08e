"""kernels.reference decode attention against a naive per-sequence computation: contexts of mixed
lengths (the bucketed path), speculative query lengths, the per-step plan reused across layers
(same tables, different caches) and rebuilt for the next step's tensors."""

from __future__ import annotations

import random

import torch

from kernels import reference as ref

BS, HKV, H, D = 16, 2, 8, 64


def _naive(query, cache, tables, lens, scale):
    """query [B, Q, H, D]; each sequence's keys taken block by block in Python, plain softmax."""
    out = torch.empty_like(query)
    q_len = query.shape[1]
    for b, n in enumerate(lens.tolist()):
        ks = torch.cat([cache[int(blk), 0] for blk in tables[b]])[:n]  # [n, Hkv, D]
        vs = torch.cat([cache[int(blk), 1] for blk in tables[b]])[:n]
        ks, vs = ks.repeat_interleave(H // HKV, 1), vs.repeat_interleave(H // HKV, 1)
        for q in range(q_len):
            visible = n - q_len + q + 1
            s = torch.einsum("hd,khd->hk", query[b, q], ks[:visible]) * scale
            out[b, q] = torch.einsum("hk,khd->hd", s.softmax(-1), vs[:visible])
    return out


def _batch(lens: list[int], num_blocks: int = 256, seed: int = 0):
    rng = random.Random(seed)
    width = max((n + BS - 1) // BS for n in lens)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range((n + BS - 1) // BS)] for n in lens]
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return tables, torch.tensor(lens, dtype=torch.int32)


def test_mixed_lengths_match_naive_attention():
    torch.manual_seed(0)
    cache = torch.randn(256, 2, BS, HKV, D)
    lens = [5, 900, 40, 17, 300, 1, 64, 2000 // 4]  # spans several buckets
    tables, seq_lens = _batch(lens)
    for q_len in (1, 3):
        query = torch.randn(len(lens), q_len, H, D)
        lens_q = seq_lens.clamp(min=q_len)
        got = ref.paged_decode_attention(query, cache, tables, lens_q, 0.125)
        torch.testing.assert_close(got, _naive(query, cache, tables, lens_q, 0.125), rtol=1e-4, atol=1e-5)


def test_plan_is_shared_by_layers_and_rebuilt_per_step():
    torch.manual_seed(1)
    layers = [torch.randn(64, 2, BS, HKV, D) for _ in range(2)]
    tables, seq_lens = _batch([30, 70, 12], num_blocks=64)
    query = torch.randn(3, 1, H, D)
    for cache in layers:  # one step: the same tables/lens, each layer its own cache
        got = ref.paged_decode_attention(query, cache, tables, seq_lens, 0.125)
        torch.testing.assert_close(got, _naive(query, cache, tables, seq_lens, 0.125), rtol=1e-4, atol=1e-5)
    # The next step: new tensors (one token longer, another block order) must not reuse the old plan.
    tables2, seq_lens2 = _batch([31, 71, 13], num_blocks=64, seed=5)
    got = ref.paged_decode_attention(query, layers[0], tables2, seq_lens2, 0.125)
    torch.testing.assert_close(got, _naive(query, layers[0], tables2, seq_lens2, 0.125), rtol=1e-4, atol=1e-5)
