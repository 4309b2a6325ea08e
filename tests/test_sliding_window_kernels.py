"""Sliding-window attention in the kernels: the torch reference ops against a dense masked oracle,
and the Triton kernels (interpreted on CPU) against the reference.

A query at position p sees the keys in (p - window, p] (transformers' sliding_window_overlay). Blocks
wholly before a sequence's window (the ones the engine frees) are filled with NaN and their table
entries kept: an op that read them at all — even masked — would return NaN, so "freed blocks are
never read" is checked too. The one exception is the reference decode op, which pads a bucket of
sequences to a common key span and so may gather (and mask) a longer sequence's out-of-window
blocks: the engine points those entries at a live block with finite values, and the test fills them
with 1e4 instead, which any visible use would show.
"""

from __future__ import annotations

import pytest
import torch
import triton_device

from kernels import reference as ref

BS = 16
HEADS, KV_HEADS, D = 4, 2, 32


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dense_window_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           window: int, scale: float) -> torch.Tensor:
    """q [L, H, D] at positions q_pos [L]; keys/values [N, Hkv, D] at positions 0..N-1."""
    g = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    scores = torch.einsum("lhd,nhd->hln", q.double(), k.double()) * scale
    k_pos = torch.arange(keys.shape[0]).view(1, -1)
    visible = (k_pos <= q_pos.view(-1, 1)) & (k_pos > q_pos.view(-1, 1) - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hln,nhd->lhd", scores.softmax(-1), v.double()).float()


def _cache_with(keys: torch.Tensor, values: torch.Tensor, table: list[int], num_blocks: int,
                poison: list[int]) -> torch.Tensor:
    """A cache holding keys/values [N, Hkv, D] at positions 0..N-1 through `table`; blocks in
    `poison` (table indices) are NaN."""
    cache = _randn(num_blocks, 2, BS, KV_HEADS, D, seed=99)
    for pos in range(keys.shape[0]):
        cache[table[pos // BS], 0, pos % BS] = keys[pos]
        cache[table[pos // BS], 1, pos % BS] = values[pos]
    for i in poison:
        cache[table[i]] = float("nan")
    return cache


# (sequence length, new tokens in this chunk, window): window not a multiple of the block size,
# window shorter than the chunk, prefix longer than the window, a window that never binds.
PREFILL_CASES = [(70, 70, 20), (100, 30, 37), (90, 7, 5), (64, 40, 16), (40, 12, 200), (600, 300, 37)]


def _prefill_case(n: int, q_len: int, window: int, seed: int):
    keys, values = _randn(n, KV_HEADS, D, seed=seed), _randn(n, KV_HEADS, D, seed=seed + 1)
    query = _randn(q_len, HEADS, D, seed=seed + 2)
    num_blocks = -(-n // BS) + 4
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: -(-n // BS)].tolist()
    prefix = n - q_len
    unread = max(0, prefix - window + 1) // BS  # blocks before the chunk's first query's window
    cache = _cache_with(keys[:prefix], values[:prefix], table, num_blocks, list(range(unread)))
    args = (query, keys[prefix:], values[prefix:], cache, torch.tensor([table], dtype=torch.int32),
            torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), D ** -0.5)
    expected = dense_window_attention(query, torch.arange(prefix, n), keys, values, window, D ** -0.5)
    return args, expected


@pytest.mark.parametrize("n,q_len,window", PREFILL_CASES)
def test_reference_prefill_window_matches_dense(n, q_len, window):
    args, expected = _prefill_case(n, q_len, window, seed=n + window)
    out = ref.prefill_attention(*args, window=window)
    assert not out.isnan().any(), "read a block outside every query's window"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_prefill_window_differs_from_full():
    """The window is not a no-op: full causal attention over the same inputs gives another answer."""
    args, expected = _prefill_case(70, 70, 20, seed=1)
    assert (ref.prefill_attention(*args) - expected).abs().max() > 1e-2


# (sequence lengths, query tokens per sequence, window)
DECODE_CASES = [([70, 33, 100], 1, 20), ([70, 33, 100], 3, 37), ([200, 190], 1, 5), ([45, 300, 47], 4, 16),
                ([30], 1, 64)]


def _decode_case(lens: list[int], q_len: int, window: int, seed: int, poison_value: float = float("nan")):
    num_blocks = sum(-(-n // BS) for n in lens) + 2
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-n // BS) for n in lens)
    caches_keys, tables, poison, expected = [], [], [], []
    cache = _randn(num_blocks, 2, BS, KV_HEADS, D, seed=98)
    query = _randn(len(lens), q_len, HEADS, D, seed=seed + 5)
    for b, n in enumerate(lens):
        nb = -(-n // BS)
        table = [perm.pop() for _ in range(nb)]
        keys, values = _randn(n, KV_HEADS, D, seed=seed + 10 * b), _randn(n, KV_HEADS, D, seed=seed + 10 * b + 1)
        for pos in range(n):
            cache[table[pos // BS], 0, pos % BS], cache[table[pos // BS], 1, pos % BS] = keys[pos], values[pos]
        poison += [table[i] for i in range(max(0, n - q_len - window + 1) // BS)]
        tables.append(table + [table[-1]] * (width - nb))
        caches_keys.append(keys)
        expected.append(dense_window_attention(query[b], torch.arange(n - q_len, n), keys, values, window, D ** -0.5))
    cache[poison] = poison_value
    args = (query, cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), D ** -0.5)
    return args, torch.stack(expected)


@pytest.mark.parametrize("lens,q_len,window", DECODE_CASES)
def test_reference_decode_window_matches_dense(lens, q_len, window):
    args, expected = _decode_case(lens, q_len, window, seed=sum(lens) + window, poison_value=1e4)
    out = ref.paged_decode_attention(*args, window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_plans_per_window_do_not_mix():
    """A model mixing full and sliding layers calls with the same tables for both: each window gets
    its own plan (masks), not the other's cached one."""
    args, expected = _decode_case([70, 33, 100], 1, 20, seed=7, poison_value=0.0)
    query, cache, tables, lens, scale = args
    windowed = ref.paged_decode_attention(query, cache, tables, lens, scale, window=20)
    full = ref.paged_decode_attention(query, cache, tables, lens, scale)
    assert torch.equal(ref.paged_decode_attention(query, cache, tables, lens, scale, window=20), windowed)
    assert (windowed - full).abs().max() > 1e-2


@pytest.fixture(scope="module")
def triton_ops():
    pytest.importorskip("triton")
    return triton_device.triton_ops()  # after conftest set TRITON_INTERPRET


@pytest.mark.slow
@pytest.mark.parametrize("n,q_len,window", PREFILL_CASES[:4])
def test_triton_prefill_window_matches_reference(triton_ops, n, q_len, window):
    args, expected = _prefill_case(n, q_len, window, seed=n + window)
    out = triton_ops.prefill_attention(*args, window=window)
    assert not out.isnan().any(), "read a block outside every query's window"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("lens,q_len,window", DECODE_CASES[:4])
@pytest.mark.parametrize("partition", [None, 64])
def test_triton_decode_window_matches_reference(lens, q_len, window, partition):
    args, expected = _decode_case(lens, q_len, window, seed=sum(lens) + window)
    out = triton_device.triton_decode()(*args, window=window, partition_tokens=partition)
    assert not out.isnan().any(), "read a block outside every query's window"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
