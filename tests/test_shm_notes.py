"""The shm connector's notes (kvtransfer/shm_notes.py), in one process: a transfer's merged `kv`
notification and its `done` go to D's caller as one datagram and the `done_ack` comes back as one;
when either note socket is unreachable the same transfer completes over ZMQ; garbage datagrams, from
strangers or from the handshaken peer's own socket, are dropped without hurting the transfers after them;
more notes than a datagram carries, more transfers ending than D's note queue holds while D is busy, and a
segment path too long for a socket, take ZMQ.
"""

from __future__ import annotations

import os
import socket
import time

import msgpack
import pytest
import test_shm_notifications
import torch

from kvtransfer import CONNECTORS, CacheLayout, TransferDone, TransferFailed, wire
from kvtransfer.shm_notes import pack_notes

LAYOUT, pair = test_shm_notifications.LAYOUT, test_shm_notifications.pair  # the same in-process P/D pair fixture

def _transfer(tx, rx, caches, rid: str, dest: list[int]) -> list:
    src = torch.randn(8, *LAYOUT.block_shape)
    rx.expect(rid, dest)
    for layer in range(LAYOUT.num_layers):
        tx.send_layer(rx.address, rid, layer, src, None, list(range(len(dest))), dest)
    fut = tx.finish_async(rid)
    events: list = []
    deadline = time.monotonic() + 10
    while not any(isinstance(e, (TransferDone, TransferFailed)) for e in events) and time.monotonic() < deadline:
        events += rx.poll(50)
    assert [type(e) for e in events if isinstance(e, (TransferDone, TransferFailed))] == [TransferDone], events
    assert fut.result(timeout=10) is True
    assert all(torch.equal(caches[layer][dest], src[:len(dest)]) for layer in range(LAYOUT.num_layers))
    return events


def test_a_transfer_is_one_datagram_each_way(pair) -> None:
    tx, rx, caches = pair
    tx.HOLD_S = 60.0  # a slow machine must not release the held notifications early (a second datagram)
    sent_before = tx.stats.bytes_sent
    _transfer(tx, rx, caches, "r1", [3, 4, 9])
    assert tx._notes.sent == 1  # the merged notification and the done, together
    assert rx._notes.sent == 1  # the acknowledgement
    assert tx.stats.bytes_sent - sent_before == 3 * LAYOUT.block_nbytes * LAYOUT.num_layers
    assert os.stat(rx._notes.path).st_mode & 0o777 == 0o600 and os.stat(tx._notes.path).st_mode & 0o777 == 0o600


def test_unreachable_note_sockets_fall_back_to_zmq(pair) -> None:
    tx, rx, caches = pair
    os.unlink(rx._notes.path)  # D's socket no longer reachable by name: P's notes take the data socket
    _transfer(tx, rx, caches, "r1", [5, 6])
    assert tx._notes.sent == 0 and rx._notes.sent == 1
    os.unlink(tx._notes.path)  # and P's: D's acknowledgement goes through its I/O thread
    _transfer(tx, rx, caches, "r2", [7])
    assert tx._notes.sent == 0 and rx._notes.sent == 1


def test_garbage_notes_are_dropped_and_transfers_go_on(pair) -> None:
    tx, rx, caches = pair
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        stranger.sendto(pack_notes([wire.encode("done", request_id="x", messages=0, bytes=0, result={})]),
                        rx._notes.path)
        stranger.sendto(pack_notes([wire.encode("done_ack", request_id="r1", ok=True, reason="")]), tx._notes.path)
    finally:
        stranger.close()
    peer = tx._notes._sock  # the handshaken sender's own socket, sending what no sender would
    for junk in (b"\x00garbage", msgpack.packb([1, 2]), msgpack.packb([]), pack_notes([b"\xc1"]),
                 pack_notes([wire.encode("cancel_ack", request_id="x")]), os.urandom(70_000)[:65_000]):
        peer.sendto(junk, rx._notes.path)
    rx.poll(0)  # drained: a Unix datagram queue holds ~10 by default, and a full one refuses the next send
    rx.expect("ghost", [1])  # a done whose counts do not match what arrived: the request fails, P is told
    peer.sendto(pack_notes([wire.encode("done", request_id="ghost", messages=0, bytes=0, result={})]),
                rx._notes.path)
    events = []
    deadline = time.monotonic() + 5
    while not any(isinstance(e, TransferFailed) for e in events) and time.monotonic() < deadline:
        events += rx.poll(50)
    assert [e.request_id for e in events if isinstance(e, TransferFailed)] == ["ghost"]
    _transfer(tx, rx, caches, "r1", [2, 8])
    assert rx.drops.counts.get("note_from_unknown_sender") == 1
    assert sum(rx.drops.counts.values()) == 7, rx.drops.counts  # the stranger's and the six junk notes
    deadline = time.monotonic() + 5
    while "note_from_unknown_receiver" not in tx._drops.counts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx._drops.counts.get("note_from_unknown_receiver") == 1


def test_transfers_ending_while_d_is_busy_overflow_to_zmq(pair) -> None:
    """D in a long step reads no notes: once its queue is full (net.unix.max_dgram_qlen, 10 by default), P's
    next `done`s are refused as datagrams and go over ZMQ. Every transfer still completes, once each."""
    tx, rx, caches = pair
    n = 14
    src = torch.randn(n, *LAYOUT.block_shape)
    futs = []
    for i in range(n):
        rx.expect(f"r{i}", [i + 1])
    for i in range(n):  # D does not poll meanwhile
        for layer in range(LAYOUT.num_layers):
            tx.send_layer(rx.address, f"r{i}", layer, src, None, [i], [i + 1])
        futs.append(tx.finish_async(f"r{i}"))
    with open("/proc/sys/net/unix/max_dgram_qlen") as f:
        qlen = int(f.read())
    if qlen + 1 < n:
        assert tx._notes.sent < n  # the rest were refused: full queue
    done: list = []
    deadline = time.monotonic() + 10
    while len(done) < n and time.monotonic() < deadline:
        done += [e.request_id for e in rx.poll(50) if isinstance(e, (TransferDone, TransferFailed))]
    assert sorted(done) == sorted(f"r{i}" for i in range(n))
    assert [f.result(timeout=10) for f in futs] == [True] * n
    assert all(torch.equal(caches[layer][i + 1], src[i]) for layer in range(LAYOUT.num_layers) for i in range(n))


@pytest.mark.parametrize("checksum", [True, False])
def test_more_notes_than_a_datagram_takes_go_over_zmq(tmp_path, checksum: bool) -> None:
    """Checksummed notifications are not merged: a 70-layer model's are 70 messages + the done, more than a
    datagram may carry (MAX_FRAMES), so they take the data socket; merged, they are one datagram."""
    layout = CacheLayout("deep", "float32", "float32", block_size=4, num_layers=70, num_kv_heads=1, head_dim=8)
    c = CONNECTORS["shm"](timeout_s=30, checksum=checksum)
    caches, scales = c.allocate_kv_caches(layout, 8)
    rx, tx = c.make_receiver(layout, caches, scales), c.make_sender(layout, "cpu")
    try:
        tx.connect(rx.address)
        src = torch.randn(4, *layout.block_shape)
        rx.expect("r", [2, 3])
        for layer in range(layout.num_layers):
            tx.send_layer(rx.address, "r", layer, src, None, [0, 1], [2, 3])
        fut = tx.finish_async("r")
        events: list = []
        deadline = time.monotonic() + 10
        while not fut.done() and time.monotonic() < deadline:
            events += rx.poll(20)
        assert fut.result(timeout=1) is True and any(isinstance(e, TransferDone) for e in events)
        assert tx._notes.sent == (0 if checksum else 1)
        assert all(torch.equal(caches[layer][[2, 3]], src[:2]) for layer in range(layout.num_layers))
    finally:
        tx.close()
        rx.close()
        c.free_kv_caches(caches)


def test_a_segment_path_too_long_for_a_socket_keeps_zmq(tmp_path) -> None:
    """A segment directory whose path leaves no room for a socket name (108 bytes on Linux): the receiver
    still starts and transfers complete, every message over ZMQ."""
    from kvtransfer.shm_segment import allocate_shared_kv_caches

    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    caches, scales, handle = allocate_shared_kv_caches(LAYOUT, 16, directory=str(deep))
    c = CONNECTORS["shm"](timeout_s=30)
    rx, tx = c.make_receiver(LAYOUT, caches, scales), c.make_sender(LAYOUT, "cpu")
    try:
        assert rx._notes is None and "notes" not in rx._extra
        tx.connect(rx.address)
        _transfer(tx, rx, caches, "r", [4, 5])
        assert tx._notes.sent == 0
    finally:
        tx.close()
        rx.close()
        handle.close()
