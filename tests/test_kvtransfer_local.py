"""KV connectors within one process (no rig of worker processes): what a process with a zmq connector
does to its allocator, the receiver's ready_fd that wakes a decode worker's poller, the shm
sender's streaming block copy, and the wake pipe that no wake-up may slip past."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kvtransfer import CacheLayout

ROOT = str(Path(__file__).resolve().parents[1])
FP32 = CacheLayout("tiny", "float32", "float32", block_size=4, num_layers=4, num_kv_heads=2, head_dim=8)

_FAULTS_SCRIPT = """
import resource, sys, torch
from kvtransfer import CONNECTORS, CacheLayout
if sys.argv[1] == "zmq":
    CONNECTORS["zmq"]().make_sender(CacheLayout("t", "float32", "float32", 4, 1, 1, 8), "cpu").close()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def transfer():  # a transfer's worth of layers alive at once, then freed: 8 x 2 MiB = 4096 pages
    return [torch.empty(1 << 19).fill_(1.0) for _ in range(8)]
transfer()
before = faults()
for _ in range(10):
    transfer()
print(faults() - before)
"""


def test_zmq_connector_keeps_freed_layer_buffers_mapped() -> None:
    """Every zmq transfer allocates multi-MiB buffers (P's packed layer, D's message); glibc would map
    each afresh and fault it in page by page. A process with a zmq sender reuses them instead,
    unless the user tuned malloc through the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}

    def faults(connector: str, **extra: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, connector], env={**env, **extra}, cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert faults("none") > 4000  # the default (8123 here): a fifth of the pages faulted in again every transfer
    assert faults("zmq") < 1000
    assert faults("zmq", MALLOC_TRIM_THRESHOLD_="131072") > 4000  # the user's setting wins


def test_receiver_ready_fd_wakes_a_poller_for_the_end_of_a_transfer() -> None:
    """A decode worker sleeps in its own poller between steps; the receiver's ready_fd turns readable
    when P's `done` arrives (not for every layer), and poll() clears it."""
    import select

    import torch

    from kvtransfer import CONNECTORS, TransferDone

    c = CONNECTORS["zmq"](timeout_s=30)
    caches, scales = c.allocate_kv_caches(FP32, 16)
    rx = c.make_receiver(FP32, caches, scales, "tcp://127.0.0.1:*")
    tx = c.make_sender(FP32, "cpu")
    try:
        tx.connect(rx.address)
        src = torch.randn(8, *FP32.block_shape)
        rx.expect("r", [3, 4])
        for layer in range(FP32.num_layers):
            tx.send_layer(rx.address, "r", layer, src, None, [0, 1], [3, 4])
        time.sleep(0.3)  # every layer is in; no `done` yet
        assert select.select([rx.ready_fd], [], [], 0)[0] == []
        tx.finish_async("r", result={"first_token": 7})
        assert select.select([rx.ready_fd], [], [], 5)[0] == [rx.ready_fd]
        events = rx.poll(0)
        assert any(isinstance(e, TransferDone) and e.request_id == "r" for e in events)
        assert select.select([rx.ready_fd], [], [], 0)[0] == []
        assert torch.equal(caches[1][3:5], src[0:2])
    finally:
        tx.close()
        rx.close()


def test_torch_dist_refuses_a_receiver_on_the_senders_own_gpu(monkeypatch) -> None:
    """NCCL cannot pair two processes on one GPU (seen on an H100: every transfer of a P/D pair on one
    GPU failed and fell back to local prefill). The handshake compares the GPUs' UUIDs and refuses with
    a message naming the fix; different GPUs (here: no GPU at all) pair as before."""
    import pytest
    import torch

    from kvtransfer import CONNECTORS, HandshakeError, TransferDone, dist_connector

    c = CONNECTORS["torch_dist"](timeout_s=30)
    caches, scales = c.allocate_kv_caches(FP32, 8)
    rx = c.make_receiver(FP32, caches, scales, "tcp://127.0.0.1:*")
    try:
        monkeypatch.setattr(dist_connector, "gpu_uuid", lambda device: "GPU-1234")  # both ends "on" one GPU
        tx = c.make_sender(FP32, "cpu")
        with pytest.raises(HandshakeError, match="own GPU .GPU-1234.*--kv-connector zmq"):
            tx.connect(rx.address)
        tx.close()
        monkeypatch.setattr(dist_connector, "gpu_uuid", lambda device: None)
        tx = c.make_sender(FP32, "cpu")
        tx.connect(rx.address)
        rx.expect("r", [2])
        src = torch.randn(4, *FP32.block_shape)
        for layer in range(FP32.num_layers):
            tx.send_layer(rx.address, "r", layer, src, None, [1], [2])
        done = tx.finish_async("r")
        deadline = time.monotonic() + 20
        while not any(isinstance(e, TransferDone) for e in rx.poll(100)):  # D scatters and acks in poll()
            assert time.monotonic() < deadline, "no TransferDone"
        assert done.result(timeout=20) and torch.equal(caches[3][2], src[1])
        tx.close()
    finally:
        rx.close()


def test_streaming_block_copy_equals_a_plain_copy() -> None:
    """copy_blocks(streaming=True) (the shm sender's copy into D's cache: streaming stores after a
    memcpy'd head up to 64-byte alignment, a memcpy'd tail) writes exactly the blocks a plain copy
    writes, for block sizes that are not multiples of 64 bytes and destinations at odd offsets, and
    touches nothing else."""
    import pytest
    import torch

    from kernels import get_ops, native_cpu
    from kvtransfer.blocks import copy_blocks

    if native_cpu.library() is None:
        pytest.fail("no native CPU library (a C compiler is a test dependency)")
    ops = get_ops(torch.device("cpu"))
    for block_shape, dtype in [((2, 4, 2, 8), torch.float32), ((2, 3, 1, 5), torch.float32),
                               ((2, 7, 1, 3), torch.uint8), ((2, 16, 2, 64), torch.float32)]:
        src = (torch.rand(40, *block_shape) * 200).to(dtype)
        for dst_ids, src_ids in [([3, 4, 5, 6], [10, 11, 12, 13]), ([0], [39]),
                                 ([7, 8, 20, 21, 22, 30], [1, 2, 5, 6, 7, 9]), (list(range(12)), list(range(25, 37)))]:
            want = torch.full((36, *block_shape), 7).to(dtype)
            got = want.clone()
            copy_blocks(ops, want, dst_ids, src, src_ids)
            copy_blocks(ops, got, dst_ids, src, src_ids, streaming=True)
            assert torch.equal(got, want), (block_shape, dst_ids)
            assert torch.equal(got[dst_ids], src[src_ids])
    # a destination that starts off 64-byte alignment (a view one float in), and a long run
    base = torch.zeros(1 + 30 * 2 * 16 * 2 * 64)
    dst = base[1:].view(30, 2, 16, 2, 64)
    src = torch.randn(30, 2, 16, 2, 64)
    copy_blocks(ops, dst, list(range(2, 27)), src, list(range(0, 25)), streaming=True)
    assert torch.equal(dst[2:27], src[:25]) and base[0] == 0 and dst[:2].abs().sum() == 0 and dst[27:].abs().sum() == 0
    for dst_ids, src_ids in [([28, 29, 30], [0, 1, 2]), ([0, 1], [29, 30]), ([-1], [0])]:  # past either end
        with pytest.raises(IndexError):
            copy_blocks(ops, dst, dst_ids, src, src_ids, streaming=True)
    assert torch.equal(dst[2:27], src[:25]) and dst[27:].abs().sum() == 0  # nothing written
    # one-block views whose stride(0) is not a block (is_contiguous ignores a size-1 dimension's stride):
    # the block's size comes from its shape, so nothing past the block is written
    wide = torch.zeros(4, 32)
    one = wide.as_strided((1, 2, 8), (64, 8, 1))  # contiguous as far as torch says
    source = torch.arange(128.0).view(4, 32).as_strided((1, 2, 8), (64, 8, 1))  # the same strides
    copy_blocks(ops, one, [0], source, [0], streaming=True)
    assert torch.equal(wide[0, :16], torch.arange(16.0)) and wide[0, 16:].abs().sum() == 0 and wide[1:].abs().sum() == 0


def test_a_wake_during_drain_is_not_lost(monkeypatch) -> None:
    """WakePipe: a wake that lands while the I/O thread drains must leave the next wake able to
    write. Draining used to clear the flag before reading the pipe: a wake in between wrote a byte the
    read swallowed, the flag stayed set over an empty pipe, and every later wake was lost until the
    poll timed out (1 s: seen as a KV transfer's acknowledgement a second late, 1 run in ~12)."""
    import select

    from kvtransfer import common

    pipe = common.WakePipe()
    try:
        pipe.wake()
        real_read, woke = os.read, []

        def read_with_a_wake_in_between(fd: int, n: int) -> bytes:
            if not woke:  # another thread enqueues and wakes while drain() runs
                woke.append(True)
                pipe.wake()
            return real_read(fd, n)

        monkeypatch.setattr(common.os, "read", read_with_a_wake_in_between)
        pipe.drain()
        monkeypatch.setattr(common.os, "read", real_read)
        pipe.wake()  # the next enqueue must make the pipe readable, or the thread sleeps out its poll
        assert select.select([pipe.rfd], [], [], 0)[0] == [pipe.rfd]
    finally:
        pipe.close()
