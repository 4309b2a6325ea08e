"""The shm connector's notifications, in one process: P writes D's shared-memory cache itself, so its
per-layer `kv` notifications are held until the request's `done` and merged into one message naming
every layer (D's I/O thread wakes once per transfer), flushed early only when a long prefill holds them
past HOLD_S; the wire refuses a several-layer message that is malformed or meant for a receiver that
takes payloads; and send_layer checks a prompt's block ids once, not once per layer."""

from __future__ import annotations

import time

import pytest
import torch

from kvtransfer import CONNECTORS, CacheLayout, LayerReceived, TransferDone, TransferFailed, wire

LAYOUT = CacheLayout("tiny", "float32", "float32", block_size=4, num_layers=4, num_kv_heads=2, head_dim=8)


@pytest.fixture
def pair():
    c = CONNECTORS["shm"](timeout_s=30)
    caches, scales = c.allocate_kv_caches(LAYOUT, 16)
    rx = c.make_receiver(LAYOUT, caches, scales)
    tx = c.make_sender(LAYOUT, "cpu")
    tx.connect(rx.address)
    yield tx, rx, caches
    tx.close()
    rx.close()
    c.free_kv_caches(caches)


def _events(rx, until: type, timeout_s: float = 5.0) -> list:
    events: list = []
    deadline = time.monotonic() + timeout_s
    while not any(isinstance(e, until) for e in events) and time.monotonic() < deadline:
        events += rx.poll(50)
    return events


def test_a_prompts_layers_arrive_as_one_message_with_the_done(pair) -> None:
    tx, rx, caches = pair
    src = torch.randn(8, *LAYOUT.block_shape)
    rx.expect("r", [3, 4, 9])
    for layer in range(LAYOUT.num_layers):
        tx.send_layer(rx.address, "r", layer, src, None, [0, 1, 5], [3, 4, 9])
    assert all(torch.equal(caches[layer][[3, 4, 9]], src[[0, 1, 5]]) for layer in range(LAYOUT.num_layers))
    time.sleep(0.2)
    assert rx.poll(0) == []  # written, but D is not woken per layer
    fut = tx.finish_async("r")
    events = _events(rx, TransferDone)
    layers = [e for e in events if isinstance(e, LayerReceived)]
    assert sorted(e.layer for e in layers) == list(range(LAYOUT.num_layers))
    assert len({e.t_monotonic_ns for e in layers}) == 1  # one message for all four layers
    done = [e for e in events if isinstance(e, TransferDone)]
    assert done and done[0].bytes == 3 * LAYOUT.block_nbytes * LAYOUT.num_layers
    assert fut.result(timeout=5) is True


def test_chunks_are_one_message_each_and_a_long_prefill_is_not_held(pair) -> None:
    """Two chunks (other blocks) make two messages; once the oldest held notification is older than
    HOLD_S, send_layer sends them, so D's idle timeout sees a long prefill alive."""
    tx, rx, caches = pair
    src = torch.randn(8, *LAYOUT.block_shape)
    rx.expect("r", [2, 3, 6, 7])
    for blocks in ([2, 3], [6, 7]):
        for layer in range(LAYOUT.num_layers):
            tx.send_layer(rx.address, "r", layer, src, None, [b - 2 for b in blocks], blocks)
    tx.finish_async("r")
    events = _events(rx, TransferDone)
    assert len({e.t_monotonic_ns for e in events if isinstance(e, LayerReceived)}) == 2
    assert any(isinstance(e, TransferDone) for e in events)

    rx.expect("long", [10])
    tx.send_layer(rx.address, "long", 0, src, None, [0], [10])
    time.sleep(tx.HOLD_S + 0.05)
    tx.send_layer(rx.address, "long", 1, src, None, [0], [10])  # the oldest is past HOLD_S: both go now
    early = _events(rx, LayerReceived)
    assert sorted(e.layer for e in early if isinstance(e, LayerReceived)) == [0, 1]
    for layer in (2, 3):
        tx.send_layer(rx.address, "long", layer, src, None, [0], [10])
    fut = tx.finish_async("long")
    assert any(isinstance(e, TransferDone) for e in _events(rx, TransferDone))  # 2 + 1 merged messages counted
    assert fut.result(timeout=5) is True


def test_checksummed_notifications_are_held_but_not_merged() -> None:
    c = CONNECTORS["shm"](timeout_s=30, checksum=True)
    caches, scales = c.allocate_kv_caches(LAYOUT, 16)
    rx, tx = c.make_receiver(LAYOUT, caches, scales), c.make_sender(LAYOUT, "cpu")
    try:
        tx.connect(rx.address)
        src = torch.randn(4, *LAYOUT.block_shape)
        rx.expect("r", [5])
        for layer in range(LAYOUT.num_layers):
            tx.send_layer(rx.address, "r", layer, src, None, [1], [5])
        tx.finish_async("r")
        events = _events(rx, TransferDone)
        assert sum(isinstance(e, LayerReceived) for e in events) == LAYOUT.num_layers
        assert any(isinstance(e, TransferDone) for e in events)
    finally:
        tx.close()
        rx.close()
        c.free_kv_caches(caches)


def test_the_wire_refuses_bad_layer_sets() -> None:
    ok = wire.parse_kv(wire.decode(wire.kv_header(LAYOUT, "r", 1, [3, 4], layers=[1, 0, 3])), LAYOUT)
    assert ok.layers == [1, 0, 3] and ok.nbytes == 3 * 2 * LAYOUT.block_nbytes
    for layer, layers, checksum in ((1, [1, 1], None), (1, [0, 1], None), (1, [1, 4], None), (1, [], None),
                                    (1, [1, 2], 7)):
        raw = wire.kv_header(LAYOUT, "r", layer, [3], checksum=checksum, layers=layers)
        with pytest.raises(wire.ProtocolError, match="layers"):
            wire.parse_kv(wire.decode(raw), LAYOUT)


def test_a_receiver_that_takes_payloads_drops_a_several_layer_message() -> None:
    """zmq carries each layer's blocks in its own message: a several-layer notification there is a
    protocol error (dropped), and the transfer it claimed to cover fails instead of reading as complete."""
    c = CONNECTORS["zmq"](timeout_s=30)
    caches, scales = c.allocate_kv_caches(LAYOUT, 16)
    rx, tx = c.make_receiver(LAYOUT, caches, scales, "tcp://127.0.0.1:*"), c.make_sender(LAYOUT, "cpu")
    try:
        tx.connect(rx.address)
        rx.expect("r", [5])
        header = wire.kv_header(LAYOUT, "r", 0, [5], layers=list(range(LAYOUT.num_layers)))
        tx._connected[rx.address].data.send_multipart([header])
        tx.finish_async("r", address=rx.address)
        events = _events(rx, TransferFailed)
        assert any(isinstance(e, TransferFailed) for e in events) and not any(
            isinstance(e, (LayerReceived, TransferDone)) for e in events)
        assert any(reason.startswith("kv") for reason in rx.drops.counts), rx.drops.counts
    finally:
        tx.close()
        rx.close()


def test_block_ids_are_checked_once_per_prompt_and_whenever_they_change(pair) -> None:
    tx, rx, _ = pair
    src = torch.randn(8, *LAYOUT.block_shape)
    rx.expect("r", [3, 4])
    tx.send_layer(rx.address, "r", 0, src, None, [0, 1], [3, 4])
    checked = tx._ids.last
    tx.send_layer(rx.address, "r", 1, src, None, [0, 1], [3, 4])
    assert tx._ids.last is checked  # the same lists: not walked again
    tx.send_layer(rx.address, "r", 2, src, None, [0, True], [3.0, 4])  # equal look-alikes: the checked ints go
    assert tx._ids.last is checked
    with pytest.raises(ValueError, match="src_block_ids"):
        tx.send_layer(rx.address, "r", 3, src, None, [0, 8], [3, 4])  # 8 is past P's 8 blocks
    with pytest.raises(ValueError, match="dest_block_ids"):
        tx.send_layer(rx.address, "r", 3, src, None, [0, 1], [3, 3])
    tx.send_layer(rx.address, "r", 3, src, None, [0, 1], [3, 4])
    fut = tx.finish_async("r")
    assert any(isinstance(e, TransferDone) for e in _events(rx, TransferDone))
    assert fut.result(timeout=5) is True


def test_an_acknowledgement_does_not_wait_for_a_copy_in_progress(pair) -> None:
    """D's done_ack resolves the finish Future on P's I/O thread while the caller's thread holds the
    sender lock (as it does for a whole layer's copy into D's memory): streamed transfers no longer
    hand that lock back and forth with the acknowledgements of the ones before."""
    tx, rx, _ = pair
    src = torch.randn(8, *LAYOUT.block_shape)
    rx.expect("first", [1])
    for layer in range(LAYOUT.num_layers):
        tx.send_layer(rx.address, "first", layer, src, None, [0], [1])
    fut = tx.finish_async("first")
    with tx._lock:  # a copy of the next request's layer, in progress
        deadline = time.monotonic() + 5
        while not fut.done() and time.monotonic() < deadline:
            rx.poll(20)
        assert fut.done() and fut.result() is True
        assert tx.stats.transfers == 1
