"""The C decode-attention kernel (kernels/native_cpu.py) against the torch reference it replaces on CPU.

The engine's greedy-parity tests (against transformers) run through it already, being the CPU default;
these pin the edges one model would not reach: grouped-query and plain heads, verification queries
(Q > 1), sliding windows that are not a multiple of the block size, contexts of one token and of whole
blocks, blocks scattered as the allocator hands them out, one sequence split over threads.
"""

from __future__ import annotations

import pytest
import torch

from kernels import NATIVE_CPU_OPS, REFERENCE_OPS, get_ops, native_cpu, reference


def _case(seed, *, b, h, hkv, d, bs, q_len, lens, spare_blocks=7):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((n + bs - 1) // bs for n in lens) + 1
    num_blocks = b * max_blocks + spare_blocks
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=g)
    # scattered and interleaved: sequence i's j-th block is anywhere in the pool
    tables = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks).int()
    query = torch.randn(b, q_len, h, d, generator=g)
    return query, cache, tables, torch.tensor(lens, dtype=torch.int32)


def test_the_library_builds_here():
    assert native_cpu.library() is not None, "no C compiler (cc/gcc) found, or the build failed: see the log"
    assert get_ops("cpu") is NATIVE_CPU_OPS


@pytest.mark.parametrize("h,hkv,d", [(8, 2, 64), (8, 4, 32), (8, 2, 32), (4, 4, 128), (6, 1, 16)])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("window", [None, 40, 7, 150])  # 150: a window over two 128-key tiles
@pytest.mark.parametrize("bs", [16, 8])
def test_equals_reference(h, hkv, d, q_len, window, bs):
    lens = [q_len, bs, bs + 1, 3 * bs, 97, 255, 40 + q_len]
    query, cache, tables, seq_lens = _case(h * d + q_len + bs, b=len(lens), h=h, hkv=hkv, d=d, bs=bs,
                                           q_len=q_len, lens=lens)
    want = reference.paged_decode_attention(query, cache, tables, seq_lens, d ** -0.5, window=window)
    got = native_cpu.paged_decode_attention(query, cache, tables, seq_lens, d ** -0.5, window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("b", [1, 5])
def test_threads_split_sequences_or_heads(threads, b):
    """Fewer sequences than threads: the work is split per KV head; otherwise per sequence."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens = [300 + 37 * i for i in range(b)]
        query, cache, tables, seq_lens = _case(b, b=b, h=8, hkv=2, d=64, bs=16, q_len=1, lens=lens)
        want = reference.paged_decode_attention(query, cache, tables, seq_lens, 0.125)
        got = native_cpu.paged_decode_attention(query, cache, tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("h,hkv,d,bs", [(8, 2, 64, 16), (8, 4, 32, 12), (4, 4, 32, 5), (16, 2, 64, 32),
                                        (32, 8, 128, 16)])
@pytest.mark.parametrize("q_len,window", [(1, None), (5, None), (1, 37), (5, 150)])
def test_one_sequence_split_by_kv_heads_is_bitwise_one_thread(h, hkv, d, bs, q_len, window):
    """One sequence over two threads (a unit per KV head) gives the very bits of one thread (a unit of the whole
    sequence, requesting its next tile while it computes), and the reference's values: small KV heads' rows
    read where they lie on both, eight keys that straddle two blocks included (a window makes them); 8 x 128
    heads copied on both."""
    lens = [311 + q_len]
    query, cache, tables, seq_lens = _case(h + d + bs + q_len, b=1, h=h, hkv=hkv, d=d, bs=bs, q_len=q_len, lens=lens)
    before, got = torch.get_num_threads(), {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = native_cpu.paged_decode_attention(query, cache, tables, seq_lens, d ** -0.5, window=window)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1], got[2])
    want = reference.paged_decode_attention(query, cache, tables, seq_lens, d ** -0.5, window=window)
    torch.testing.assert_close(got[2], want, rtol=1e-5, atol=2e-6)


def test_unused_table_entries_are_never_read():
    """Entries past a sequence's blocks, and behind its window, may be anything (the engine's padding,
    freed blocks): the kernel must not read them, and the bounds check must not refuse them."""
    query, cache, tables, seq_lens = _case(3, b=2, h=4, hkv=2, d=32, bs=16, q_len=1, lens=[100, 20])
    want = reference.paged_decode_attention(query, cache, tables, seq_lens, 0.2, window=24)
    tables[1, 2:] = 10**6  # past sequence 1's two blocks
    tables[0, :4] = -5  # behind sequence 0's window: keys 76..99 live in blocks 4..6
    got = native_cpu.paged_decode_attention(query, cache, tables, seq_lens, 0.2, window=24)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_out_of_range_blocks_and_lengths_are_refused():
    query, cache, tables, seq_lens = _case(4, b=2, h=4, hkv=2, d=32, bs=16, q_len=1, lens=[40, 20])
    bad = tables.clone()
    bad[0, 1] = cache.shape[0]
    with pytest.raises(ValueError, match="block ids must lie in"):
        native_cpu.paged_decode_attention(query, cache, bad, seq_lens, 0.2)
    with pytest.raises(ValueError, match="seq_lens must lie in"):
        native_cpu.paged_decode_attention(query, cache, tables, torch.tensor([40, 16 * tables.shape[1] + 1]), 0.2)


def test_small_tables_are_checked_in_python_with_the_same_verdicts(monkeypatch):
    """Small block tables (a batch-1 step, an EAGLE head's passes) are checked over lists; over random
    tables, lengths and windows that path and the tensor path accept and refuse alike, message for message."""
    import random

    rng = random.Random(0)
    verdicts = []
    for trial in range(3000):
        b, width, bs, nb = rng.randint(1, 4), rng.randint(1, 8), rng.choice([2, 4, 16]), rng.randint(4, 30)
        tables = torch.randint(-2 if trial % 3 == 0 else 0, nb + (3 if trial % 3 == 1 else 0), (b, width),
                               dtype=torch.int32)
        q, window = rng.randint(1, 2), rng.choice([None, None, 3, 5, 17])
        lens = torch.randint(q, width * bs + (2 if trial % 5 == 0 else 1), (b,), dtype=torch.int32)
        got = []
        for small in (10**9, 0):
            monkeypatch.setattr(native_cpu, "SMALL_TABLE", small)
            native_cpu._last_checked[0] = None
            try:
                native_cpu._checked(tables, lens, q, nb, bs, window)
                got.append("ok")
            except ValueError as exc:
                got.append(str(exc))
        assert got[0] == got[1], (tables.tolist(), lens.tolist(), q, nb, bs, window)
        verdicts.append(got[0] == "ok")
    assert 0.2 < sum(verdicts) / len(verdicts) < 0.8  # both verdicts well represented


def test_other_dtypes_take_the_reference():
    """A quantized or half cache is not the kernel's: the reference's result, bit for bit."""
    query, cache, tables, seq_lens = _case(5, b=3, h=8, hkv=2, d=64, bs=16, q_len=1, lens=[50, 17, 120])
    half = cache.to(torch.bfloat16)
    assert torch.equal(native_cpu.paged_decode_attention(query.bfloat16(), half, tables, seq_lens, 0.125),
                       REFERENCE_OPS.paged_decode_attention(query.bfloat16(), half, tables, seq_lens, 0.125))


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_store_kv_equals_the_reference_and_refuses_a_slot_past_the_cache(rows):
    """K/V rows (contiguous, or the column halves of hidden states as EAGLE's cache layer stores them),
    -1 slots skipped: the cache bitwise the reference's; a slot past the cache writes nothing."""
    g = torch.Generator().manual_seed(rows)
    cache = torch.randn(40, 2, 16, 4, 32, generator=g)
    slots = torch.randperm(40 * 16, generator=g)[:rows]
    slots[1::3] = -1
    hidden = torch.randn(rows, 256, generator=g)
    for key, value in ((torch.randn(rows, 4, 32, generator=g), torch.randn(rows, 4, 32, generator=g)),
                       (hidden[:, :128].reshape(rows, 4, 32), hidden[:, 128:].reshape(rows, 4, 32))):
        want, got = cache.clone(), cache.clone()
        reference.store_kv(key, value, want, slots)
        native_cpu.store_kv(key, value, got, slots)
        assert torch.equal(got, want) and not torch.equal(got, cache)
    past = slots.clone()
    past[-1] = 40 * 16
    with pytest.raises(IndexError):
        native_cpu.store_kv(key, value, got, past)
    assert torch.equal(got, want)  # nothing written
    half = cache.to(torch.bfloat16)  # not the kernel's: the reference's result
    want, got = half.clone(), half.clone()
    reference.store_kv(key.bfloat16(), value.bfloat16(), want, slots)
    native_cpu.store_kv(key.bfloat16(), value.bfloat16(), got, slots)
    assert torch.equal(got, want)


# ------------------------------------------------------------------ fused elementwise ops (kernels/fused.py)

def _torch_forms(monkeypatch, fn, *args):
    """The same kernels.fused call on its torch path (the reference: Hugging Face's arithmetic)."""
    from kernels import fused

    monkeypatch.setattr(fused, "ALLOWED", False)  # as TANDEM_KERNELS=reference at start-up
    try:
        return fn(*args)
    finally:
        monkeypatch.setattr(fused, "ALLOWED", True)


@pytest.mark.parametrize("rows", [1, 7, 130])  # 130: rows split over threads
def test_fused_norms_equal_torch(monkeypatch, rows):
    from kernels import fused

    g = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, 96, generator=g) * 3, torch.randn(rows, 96, generator=g)
    weight = torch.randn(96, generator=g)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-6),
                               _torch_forms(monkeypatch, fused.rms_norm, x, weight, 1e-6), rtol=2e-6, atol=1e-6)
    residual, normed = fused.add_rms_norm(x, delta, weight, 1e-5)
    want_residual, want_normed = _torch_forms(monkeypatch, fused.add_rms_norm, x, delta, weight, 1e-5)
    assert torch.equal(residual, want_residual)  # one fp32 add: bit for bit
    torch.testing.assert_close(normed, want_normed, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 130])
def test_fused_silu_and_mul_equals_torch(monkeypatch, rows):
    from kernels import fused

    gate_up = torch.randn(rows, 2 * 176, generator=torch.Generator().manual_seed(rows)) * 6  # tails of the exp
    got = fused.silu_and_mul(gate_up)
    assert got.shape == (rows, 176)
    torch.testing.assert_close(got, _torch_forms(monkeypatch, fused.silu_and_mul, gate_up), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [3, 130])
def test_fused_rope_in_place_on_the_qkv_output_is_bitwise_torch(monkeypatch, rows):
    """RoPE on the q and k heads of a fused q/k/v row, in place: the same roundings as torch's
    x * cos + rotate_half(x) * sin (no fused multiply-add), and v untouched."""
    from kernels import fused

    heads, kv_heads, d = 4, 2, 32
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    angles = torch.rand(rows, 1, d // 2, generator=g) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    before = qkv.clone()
    want = _torch_forms(monkeypatch, fused.rotate, before[:, :(heads + kv_heads) * d].reshape(rows, -1, d), cos, sin)
    got = fused.rotate(qkv[:, :(heads + kv_heads) * d].reshape(rows, -1, d), cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place, as the attention layer relies on
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], before[:, (heads + kv_heads) * d:])


def test_argmax_rows_is_torch_argmax_ties_nan_and_inf_included():
    from kernels import fused

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 32000, generator=g)  # 37 rows: split over threads
    x[3, 17] = x[3, 25000] = 50.0  # a tie: the first index wins
    x[4, 31999] = 60.0  # the last column
    x[5, 100] = float("nan")  # NaN is the maximum, as in torch
    x[5, 200] = float("nan")
    x[6] = float("-inf")  # nothing finite: index 0
    x[7, 0] = float("inf")
    assert fused.argmax_rows(x) == x.argmax(-1).tolist()
    assert fused.argmax_rows(x)[3:8] == [17, 31999, 100, 0, 0]
    # rows full of ties (the first index must win across the 32 positions a word is split into), widths
    # that end in a partial word, -inf and NaN in random places
    for cols in (1, 31, 32, 33, 100, 4096 + 7):
        y = torch.randint(0, 4, (24, cols), generator=g).float()
        y[1] = float("-inf")
        y[2, -1] = float("nan")
        y[3, ::3] = float("-inf")
        y[4, cols // 2] = float("inf")
        assert fused.argmax_rows(y) == y.argmax(-1).tolist(), cols


def test_without_a_compiler_the_reference_runs_and_says_so(tmp_path):
    """No usable C compiler (here: CC is `false`) and an empty cache: one warning, torch's results."""
    import os
    import subprocess
    import sys

    code = """
import logging, torch
logging.basicConfig()
from kernels import fused, native_cpu, reference
assert native_cpu.library() is None
q, cache = torch.randn(2, 1, 4, 32), torch.randn(6, 2, 16, 2, 32)
tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 5], dtype=torch.int32)
assert torch.equal(native_cpu.paged_decode_attention(q, cache, tables, lens, 0.2),
                   reference.paged_decode_attention(q, cache, tables, lens, 0.2))
x, w = torch.randn(3, 32), torch.randn(32)
assert torch.equal(fused.rms_norm(x, w, 1e-6), fused._torch_rms_norm(x, w, 1e-6))
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CC": "false", "TANDEM_CACHE_DIR": str(tmp_path), "PYTHONPATH": root}
    env.pop("TANDEM_KERNELS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr.count("native CPU kernels unavailable, using the torch reference ops") == 1, out.stderr
