"""tandem.layers.linear: the oneDNN CPU linear computes what F.linear computes, falls back where it must,
and TANDEM_LINEAR picks the path (bad values are a clear error)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tandem.layers import linear as lin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BIG = (512, 1024)  # (in, out)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_fp32(rows, bias):
    torch.manual_seed(rows)
    layer = lin.Linear(*BIG, bias=bias)
    x = torch.randn(rows, BIG[0])
    with torch.inference_mode():
        got = layer(x)
    want = F.linear(x, layer.weight, layer.bias)
    assert got.shape == (rows, BIG[1]) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(lin.backend() != "onednn", reason="oneDNN is not available in this torch build")
@pytest.mark.parametrize("threads", [1, 2])
def test_every_weight_takes_onednn_packed_and_is_repacked_when_written(monkeypatch, threads):
    """Small weights too, at any thread count, past the small-batch kernel's rows (packed, oneDNN beats
    F.linear on the shipped model's weights); the packed copy follows the weight when it is loaded or
    replaced."""
    calls = []
    real = lin._ONEDNN
    monkeypatch.setattr(lin, "_ONEDNN", lambda *a: calls.append(a[1].is_mkldnn) or real(*a))
    layer = lin.Linear(64, 48, bias=True)
    x = torch.randn(lin.SMALL_BATCH + 1, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            first = layer(x)
            packed = layer.packed_weight()
            assert layer.packed_weight() is packed  # made once
            with torch.no_grad():
                layer.weight.mul_(2)  # as load_state_dict writes weights
            second = layer(x)
            assert layer.packed_weight() is not packed
    finally:
        torch.set_num_threads(before)
    assert calls == [True, True]
    torch.testing.assert_close(second - layer.bias, 2 * (first - layer.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_small_batches_of_bf16_exact_weights_use_their_bf16_bits(monkeypatch, threads, bias):
    """A weight that is exactly bf16 (a bf16 checkpoint served in fp32) multiplies from a bf16 copy at up
    to SMALL_BATCH_BF16 rows, with fp32 accumulation: as exact as oneDNN's fp32 product. An odd shape (K not a
    multiple of 8, N not of the thread split) covers the tails; a larger batch goes to oneDNN, and a
    weight that stops being exactly bf16 goes to the fp32 kernel."""
    calls = []
    real = lin._ONEDNN
    monkeypatch.setattr(lin, "_ONEDNN", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    torch.manual_seed(threads)
    layer = lin.Linear(300, 77, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())
    plain = lin.Linear(64, 48)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for rows in range(1, lin.SMALL_BATCH_BF16 + 2):
                x = torch.randn(rows, 300)
                want = F.linear(x.double(), layer.weight.double(), None if bias is False else layer.bias.double())
                torch.testing.assert_close(layer(x).double(), want, rtol=0, atol=2e-6)
            assert layer._bf16 is not None and layer._bf16.dtype == torch.bfloat16
            assert calls == [lin.SMALL_BATCH_BF16 + 1]  # only the batch past SMALL_BATCH_BF16 went to oneDNN
            calls.clear()
            with torch.no_grad():
                layer.weight[0, 0] += 1e-4  # no longer a bf16 value: checked again, the fp32 kernel from now on
            x = torch.randn(lin.SMALL_BATCH, 300)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            assert layer._bf16 is None and not layer._plan[3] and calls == []
            layer(torch.randn(lin.SMALL_BATCH + 1, 300))  # fp32 past SMALL_BATCH: oneDNN
            assert calls == [lin.SMALL_BATCH + 1]
            plain(torch.randn(lin.SMALL_BATCH + 1, 64))
            assert plain._bf16 is None and calls[-1] == lin.SMALL_BATCH + 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_small_batches_of_fp32_weights_take_the_c_kernel(monkeypatch, threads, bias):
    """An fp32 weight that is not bf16-exact: up to SMALL_BATCH rows through the C kernel's fp32
    variant, as exact as an fp32 BLAS (odd K and N cover the tails; a big weight is split over threads);
    more rows, or a non-contiguous input, go to oneDNN. The layers are made under inference_mode, where a
    weight has no version counter."""
    calls = []
    real = lin._ONEDNN
    monkeypatch.setattr(lin, "_ONEDNN", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    torch.manual_seed(10 + threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for k_in, n_out in ((300, 77), (512, 1031)):
                layer = lin.Linear(k_in, n_out, bias=bias)
                for rows in range(1, lin.SMALL_BATCH + 2):
                    x = torch.randn(rows, k_in)
                    want = F.linear(x.double(), layer.weight.double(), None if not bias else layer.bias.double())
                    # fp32 rounding of a K-term sum (one accumulator chain per 8 lanes past 3 rows): a few
                    # 1e-6; a product lost or doubled in a tail would be off by ~1e-2
                    torch.testing.assert_close(layer(x).double(), want, rtol=0, atol=5e-6)
                assert layer._bf16 is None and calls == [lin.SMALL_BATCH + 1]
                calls.clear()
            x = torch.randn(k_in, 2).t()  # a transposed view: the C kernel needs rows back to back
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            assert calls == [2]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [0, 1, 8, 300])
def test_packed_weight_any_row_count(rows):
    layer = lin.Linear(96, 40)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_bf16_and_non_contiguous_input():
    torch.manual_seed(0)
    w = torch.randn(BIG[1], BIG[0]) / BIG[0] ** 0.5  # outputs of order 1: fp32 sums agree to ~1e-6
    x = torch.randn(BIG[0], 5).t()  # a transposed view, as attention output reshapes can be
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    got = lin.linear(x.bfloat16(), w.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, w), rtol=0.05, atol=0.05)


def test_autograd_falls_back():
    layer = lin.Linear(8, 4)
    layer(torch.randn(2, 8)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (4, 8)


def test_onednn_is_the_default_where_available():
    assert lin.backend() == ("onednn" if torch.backends.mkldnn.is_available() else "torch")


def _import_with(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_LINEAR": value, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", "from tandem.layers import linear; print(linear.backend())"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_env_switch_and_bad_value():
    out = _import_with("torch")
    assert out.returncode == 0 and out.stdout.strip() == "torch", out.stderr
    out = _import_with("mkl")
    assert out.returncode != 0 and "TANDEM_LINEAR must be 'onednn' or 'torch'" in out.stderr


def test_small_batch_plan_follows_a_replaced_or_written_weight_and_bias():
    """_small_batch plans the C call once per weight/bias version: a bias or weight replaced by a new
    tensor, or written in place, is what the next call multiplies by."""
    torch.manual_seed(0)
    layer = lin.Linear(64, 32, bias=True)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())
    x = torch.randn(2, 64)

    def check() -> None:
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)

    check()
    assert layer._plan is not None and layer._plan[3]  # the bf16 kernel
    layer.bias = torch.nn.Parameter(torch.randn(32))  # replaced
    check()
    with torch.no_grad():
        layer.bias.add_(3.0)  # written in place
        layer.weight.mul_(2.0)  # still bf16-exact: the bf16 copy must be made again
    check()
    layer.weight = torch.nn.Parameter(torch.randn(32, 64))  # replaced by a plain fp32 weight
    check()
    assert layer._plan is not None and not layer._plan[3]  # the fp32 kernel


def test_row_buckets_bound_the_padding_and_the_number_of_shapes():
    """Above BUCKET_FROM rows a oneDNN product runs at a bucketed row count (oneDNN builds a primitive
    per row count, ~1 ms per shape): never fewer rows, little padding, few distinct counts."""
    assert [lin.bucket_rows(r) for r in (0, 1, lin.BUCKET_FROM)] == [0, 1, lin.BUCKET_FROM]
    for rows in range(lin.BUCKET_FROM + 1, 8193):
        padded = lin.bucket_rows(rows)
        assert rows <= padded <= rows * 1.125 and (rows < 256 or padded <= rows * 1.032)
        assert lin.bucket_rows(padded) == padded
    assert len({lin.bucket_rows(r) for r in range(lin.BUCKET_FROM + 1, 4097)}) <= 160


@pytest.mark.skipif(lin.backend() != "onednn", reason="oneDNN is not available in this torch build")
@pytest.mark.parametrize("rows", [65, 257, 300, 1001])
def test_products_past_the_bucket_start_run_padded_and_give_the_same_rows(monkeypatch, rows):
    seen = []
    real = lin._ONEDNN
    monkeypatch.setattr(lin, "_ONEDNN", lambda *a: seen.append(a[0].shape[0]) or real(*a))
    torch.manual_seed(rows)
    layer = lin.Linear(96, 40)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = layer(x)
    assert seen == [lin.bucket_rows(rows)] and seen[0] > rows
    assert got.shape == (rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-weights", "fp32-weights"])
def test_small_batches_give_the_same_bits_at_any_thread_count(bf16):
    """The C kernel splits the weight rows over threads and runs them two at a time (one input row: four): with
    rows per thread that do not divide evenly some row is alone. ThreadBackoff changes the thread count while
    serving, so each output must come out bit for bit the same however the rows were split (and close to
    F.linear)."""
    torch.manual_seed(5)
    layer = lin.Linear(690, 255, bias=True)  # odd rows, K = 43 x 16 + 2 (a scalar tail), big enough to thread
    if bf16:
        layer.weight.data = layer.weight.data.to(torch.bfloat16).float()
    before = torch.get_num_threads()
    try:
        for rows in range(1, 9):
            x = torch.randn(rows, 690)
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                with torch.inference_mode():
                    outs.append(layer(x))
            assert all(torch.equal(outs[0], y) for y in outs[1:]), rows
            assert torch.allclose(outs[0], F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)
