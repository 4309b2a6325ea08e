"""Triton kernels vs the torch reference ops (kernels/reference.py): store, decode and prefill attention,
the dispatch contract (gather/scatter and the engine-level check: tests/test_kernels_engine.py).

Without a GPU these run under TRITON_INTERPRET=1 (set by conftest.py before triton is imported;
this file imports triton only inside fixtures, never at collection time), so shapes stay small.
Tolerances, all against the reference on the same (already quantized) cache:
  fp32 1e-5 | fp16 2e-3 | bf16 2e-2 (abs and rel), store_kv and gather/scatter bit-exact.
Quantization error itself (attention over an int8 / fp8 cache vs over the fp32 values it was made
from) is bounded separately: int8 3e-2, fp8 e4m3 1.5e-1 absolute on unit-variance inputs.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import triton_device

from kernels import reference as ref
from kernels.reference import QUANT_MAX

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
QUANT_TOL = {torch.int8: 3e-2, torch.float8_e4m3fn: 1.5e-1}
BS = 16


@pytest.fixture(scope="module")
def ops():
    return triton_device.triton_ops()  # imports triton: after conftest set TRITON_INTERPRET


@pytest.fixture(scope="module")
def decode_split():
    return triton_device.triton_decode()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype=torch.float32, seed: int = 0, strided: bool = False) -> torch.Tensor:
    """Unit normal values; strided=True returns a non-contiguous view (rows of a wider buffer, like
    the q/k/v slices of a fused projection)."""
    if not strided:
        return torch.randn(*shape, generator=_gen(seed)).to(dtype)
    wide = torch.randn(*shape[:-1], shape[-1] + 24, generator=_gen(seed)).to(dtype)
    return wide[..., 8:8 + shape[-1]]


def _make_cache(num_blocks: int, kv_heads: int, head_dim: int, cache_dtype: torch.dtype, seed: int = 1,
                block_size: int = BS) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(cache, scale or None, the fp32 values the cache was made from)."""
    full = _randn(num_blocks, 2, block_size, kv_heads, head_dim, seed=seed)
    if cache_dtype in QUANT_MAX:
        q, s = ref.quantize_rows(full, cache_dtype)
        return q, s, full
    return full.to(cache_dtype), None, full


def _block_tables(seq_lens: list[int], num_blocks: int, extra_cols: int = 1, seed: int = 2,
                  block_size: int = BS) -> torch.Tensor:
    """Shuffled (non-contiguous) distinct block ids per sequence, padded with valid ids past the end."""
    width = max(-(-n // block_size) for n in seq_lens) + extra_cols
    g = _gen(seed)
    return torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in seq_lens]).to(torch.int32)


def _close(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


# ---------------------------------------------------------------------------------------------- store_kv

STORE_CASES = [  # (cache dtype, input dtype, kv heads, head dim)
    (torch.float32, torch.float32, 2, 64),
    (torch.float16, torch.float32, 1, 64),
    (torch.bfloat16, torch.float32, 4, 128),
    (torch.bfloat16, torch.bfloat16, 2, 64),
    (torch.int8, torch.float32, 2, 128),
    (torch.int8, torch.bfloat16, 3, 64),
    (torch.float8_e4m3fn, torch.float32, 2, 64),
    (torch.float8_e4m3fn, torch.float16, 1, 128),
]


@pytest.mark.parametrize("cache_dtype,in_dtype,kv_heads,head_dim", STORE_CASES)
def test_store_kv_matches_reference_bit_exact(ops, cache_dtype, in_dtype, kv_heads, head_dim):
    tokens, num_blocks = 21, 6
    key = _randn(tokens, kv_heads, head_dim, dtype=in_dtype, seed=3, strided=True) * 4
    value = _randn(tokens, kv_heads, head_dim, dtype=in_dtype, seed=4, strided=True)
    key[2] = 0  # an all-zero row exercises the 1e-8 scale floor
    key[4, 0, :4] = torch.tensor([-1e-6, 1e-6, -0.0, 3e-7])  # round to -0 / +0 in fp8: the sign bit must match
    slots = torch.randperm(num_blocks * BS, generator=_gen(5))[:tokens]
    slots[[0, 7, 20]] = -1  # skipped rows (CUDA-graph padding)
    expected, mine = (_make_cache(num_blocks, kv_heads, head_dim, cache_dtype, seed=6)[:2] for _ in range(2))
    ref.store_kv(key, value, expected[0], slots, expected[1])
    ops.store_kv(key, value, mine[0], slots, mine[1])  # untouched slots keep the random fill
    assert torch.equal(_bits(mine[0]), _bits(expected[0]))
    if cache_dtype in QUANT_MAX:
        assert torch.equal(mine[1], expected[1])


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_store_kv_quantization_error_is_bounded(ops, cache_dtype):
    key, value = _randn(9, 2, 64, seed=7) * 10, _randn(9, 2, 64, seed=8)
    cache, scale, _ = _make_cache(1, 2, 64, cache_dtype)
    ops.store_kv(key, value, cache, torch.arange(9), scale)
    back = ref.dequantize_rows(cache[0, :, :9], scale[0, :, :9], torch.float32)
    for x, y in ((key, back[0]), (value, back[1])):
        step = x.abs().amax(-1, keepdim=True) / QUANT_MAX[cache_dtype]  # the per-row scale
        # int8 rounds to the nearest multiple of the scale; e4m3 keeps 3 mantissa bits (rel 2^-4).
        bound = step / 2 if cache_dtype == torch.int8 else torch.maximum(x.abs() / 16, step * 2 ** -9)
        assert bool(((x - y).abs() <= bound + 1e-6).all())


# ---------------------------------------------------------------------------------- paged decode attention

DECODE_CASES = [  # (query dtype, heads, kv heads, head dim, Q, forced partition or None)
    (torch.float32, 4, 4, 64, 1, None),  # GQA 1 (MHA)
    (torch.float32, 8, 2, 64, 1, 64),  # GQA 4, split context + merge
    (torch.float32, 8, 1, 128, 1, None),  # GQA 8 (MQA)
    (torch.float32, 8, 2, 64, 3, None),  # Q = 3 (speculative verification), causal among them
    (torch.float32, 8, 1, 64, 4, 64),  # Q > 1 and split together
    (torch.float16, 8, 2, 128, 1, None),
    (torch.float16, 16, 2, 64, 2, 64),  # GQA 8, Q = 2, split
    (torch.bfloat16, 4, 1, 64, 1, 64),
    (torch.bfloat16, 8, 8, 128, 2, None),
]


def _decode_inputs(dtype, heads, kv_heads, head_dim, q_len, cache_dtype, seed=10):
    seq_lens = [37, 70, q_len + 2, 129]  # none a multiple of the block size; one barely above Q
    num_blocks = 24
    cache, scale, full = _make_cache(num_blocks, kv_heads, head_dim, cache_dtype, seed=seed)
    tables = _block_tables(seq_lens, num_blocks, seed=seed + 1)
    query = _randn(len(seq_lens), q_len, heads, head_dim, dtype=dtype, seed=seed + 2, strided=True)
    return query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale, full


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,q_len,partition", DECODE_CASES)
def test_paged_decode_matches_reference(decode_split, dtype, heads, kv_heads, head_dim, q_len, partition):
    query, cache, tables, lens, _, _ = _decode_inputs(dtype, heads, kv_heads, head_dim, q_len, dtype)
    expected = ref.paged_decode_attention(query, cache, tables, lens, head_dim ** -0.5)
    out = decode_split(query, cache, tables, lens, head_dim ** -0.5, partition_tokens=partition)
    _close(out, expected, TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype,q_len,partition", [(torch.float32, 1, 64), (torch.bfloat16, 2, None)])
def test_paged_decode_quantized_cache(decode_split, cache_dtype, dtype, q_len, partition):
    query, cache, tables, lens, scale, full = _decode_inputs(dtype, 8, 2, 64, q_len, cache_dtype)
    sm = 64 ** -0.5
    out = decode_split(query, cache, tables, lens, sm, scale, partition_tokens=partition)
    _close(out, ref.paged_decode_attention(query, cache, tables, lens, sm, scale), TOL[dtype])
    unquantized = ref.paged_decode_attention(query.float(), full, tables, lens, sm)
    assert (out.float() - unquantized).abs().max().item() < QUANT_TOL[cache_dtype] + TOL[dtype]


def test_paged_decode_other_block_size(ops):
    """Tiles span cache blocks by token index, so any block size works (8 here: 8 blocks per tile)."""
    seq_lens = [45, 9]
    cache, _, _ = _make_cache(16, 2, 64, torch.float32, block_size=8)
    tables = _block_tables(seq_lens, 16, block_size=8)
    query = _randn(2, 1, 4, 64, seed=11)
    lens = torch.tensor(seq_lens)
    _close(ops.paged_decode_attention(query, cache, tables, lens, 0.125),
           ref.paged_decode_attention(query, cache, tables, lens, 0.125), TOL[torch.float32])


# ------------------------------------------------------------------------------------- prefill attention

PREFILL_CASES = [  # (query dtype, heads, kv heads, head dim)
    (torch.float32, 4, 4, 64),
    (torch.float32, 8, 2, 128),
    (torch.float32, 8, 1, 64),
    (torch.float16, 8, 2, 64),
    (torch.bfloat16, 8, 1, 128),
]


def _prefill_inputs(dtype, heads, kv_heads, head_dim, cache_dtype, seed=20):
    # (new tokens, cached prefix): no prefix; prefix inside one block; an empty chunk; a chunk longer
    # than one 32-row tile after a prefix that ends mid-block; a block-aligned prefix.
    chunks = [(5, 0), (9, 3), (0, 16), (41, 21), (16, 32)]
    q_lens = [c for c, _ in chunks]
    seq_lens = [c + p for c, p in chunks]
    num_blocks = 20
    cache, scale, full = _make_cache(num_blocks, kv_heads, head_dim, cache_dtype, seed=seed)
    tables = _block_tables(seq_lens, num_blocks, seed=seed + 1)
    t = sum(q_lens)
    query = _randn(t, heads, head_dim, dtype=dtype, seed=seed + 2, strided=True)
    key = _randn(t, kv_heads, head_dim, dtype=dtype, seed=seed + 3, strided=True)
    value = _randn(t, kv_heads, head_dim, dtype=dtype, seed=seed + 4, strided=True)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return query, key, value, cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32), scale, full


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", PREFILL_CASES)
def test_prefill_matches_reference(ops, dtype, heads, kv_heads, head_dim):
    q, k, v, cache, tables, qsl, lens, _, _ = _prefill_inputs(dtype, heads, kv_heads, head_dim, dtype)
    sm = head_dim ** -0.5
    _close(ops.prefill_attention(q, k, v, cache, tables, qsl, lens, sm),
           ref.prefill_attention(q, k, v, cache, tables, qsl, lens, sm), TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_prefill_quantized_cache(ops, cache_dtype):
    q, k, v, cache, tables, qsl, lens, scale, full = _prefill_inputs(torch.float32, 8, 2, 64, cache_dtype)
    out = ops.prefill_attention(q, k, v, cache, tables, qsl, lens, 0.125, scale)
    _close(out, ref.prefill_attention(q, k, v, cache, tables, qsl, lens, 0.125, scale), TOL[torch.float32])
    unquantized = ref.prefill_attention(q, k, v, full, tables, qsl, lens, 0.125)
    assert (out - unquantized).abs().max().item() < QUANT_TOL[cache_dtype]


def test_store_prefill_decode_pipeline(ops):
    """The engine's sequence of calls, all Triton: chunked prefill (store, attend), then a decode
    step reading everything back from the int8 cache; compared with the same calls on reference."""
    prompt, heads, kv_heads, d = 23, 8, 2, 64
    tables = _block_tables([prompt + 1], 8)
    slot = lambda pos: int(tables[0, pos // BS]) * BS + pos % BS  # noqa: E731
    k_all, v_all = _randn(prompt + 1, kv_heads, d, seed=30), _randn(prompt + 1, kv_heads, d, seed=31)
    q_all = _randn(prompt + 1, heads, d, seed=32)
    results = []
    for impl in (ref, ops):
        cache, scale, _ = _make_cache(8, kv_heads, d, torch.int8)
        outs = []
        for lo, hi in ((0, 10), (10, prompt)):  # two prefill chunks
            slots = torch.tensor([slot(p) for p in range(lo, hi)])
            impl.store_kv(k_all[lo:hi], v_all[lo:hi], cache, slots, scale)
            qsl, lens = torch.tensor([0, hi - lo], dtype=torch.int32), torch.tensor([hi], dtype=torch.int32)
            outs.append(impl.prefill_attention(q_all[lo:hi], k_all[lo:hi], v_all[lo:hi], cache, tables, qsl,
                                               lens, 0.125, scale))
        impl.store_kv(k_all[prompt:], v_all[prompt:], cache, torch.tensor([slot(prompt)]), scale)
        outs.append(impl.paged_decode_attention(q_all[prompt:].unsqueeze(0), cache, tables,
                                                torch.tensor([prompt + 1]), 0.125, scale)[0])
        results.append(torch.cat(outs))
    _close(results[1], results[0], TOL[torch.float32])


# --------------------------------------------------------------------------------- dispatch and contract

def test_dispatch_and_signatures(ops, monkeypatch):
    from kernels import REFERENCE_OPS, get_ops
    from kernels.triton_ops import TRITON_OPS

    monkeypatch.setenv("TANDEM_KERNELS", "triton")
    assert get_ops("cpu") is TRITON_OPS and ops.name == "triton"
    monkeypatch.setenv("TANDEM_KERNELS", "reference")
    assert get_ops("cpu") is REFERENCE_OPS
    for name in ("store_kv", "paged_decode_attention", "prefill_attention", "gather_blocks", "scatter_blocks"):
        want = list(inspect.signature(getattr(REFERENCE_OPS, name)).parameters.values())
        got = list(inspect.signature(getattr(ops, name)).parameters.values())
        assert [(p.name, p.default) for p in got[:len(want)]] == [(p.name, p.default) for p in want], name
        assert all(p.kind is p.KEYWORD_ONLY for p in got[len(want):]), name  # extras never shift positions


def test_bad_inputs_raise_clear_errors(ops):
    cache, _, _ = _make_cache(4, 2, 64, torch.int8)
    query, tables, lens = _randn(1, 1, 3, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5])
    with pytest.raises(ValueError, match="kv_scale"):
        ops.paged_decode_attention(_randn(1, 1, 4, 64), cache, tables, lens, 0.1)
    fp_cache = torch.zeros(4, 2, BS, 2, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_decode_attention(query, fp_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="kv_cache must be"):
        ops.store_kv(_randn(1, 2, 64), _randn(1, 2, 64), torch.zeros(4, BS, 2, 64), torch.tensor([0]))
