"""BaseReceiver: the decode-side machinery every connector shares.

Two threads, one rule: only the caller's thread (expect / poll / cancel) touches D's cache and the
request table. A daemon I/O thread (receiver_io.py) owns the ZMQ ROUTER socket and hands validated
messages over through an inbox queue.

Life of an expected request in poll():
  1. expect(id, blocks): only data for expected requests, from one sender, into these blocks counts.
  2. each `kv` message: blocks written into the cache (zmq / torch_dist) or already there (shm);
     LayerReceived(id, layer).
  3. `done` from the sender (messages, bytes): once that many messages arrived and every layer covers
     every expected block -> TransferDone + ack; a shortfall -> TransferFailed + nack.
  4. cancel() / idle timeout: the request is retired, every sender told to stop; for shm (the sender
     writes D's memory itself) TransferFailed waits for the senders' cancel_ack (bounded by
     FENCE_TIMEOUT_S) so that the blocks are safe to reuse once it is reported.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, ClassVar

import structlog
import torch
import zmq

from kernels import get_ops
from kvtransfer import wire
from kvtransfer.base import CacheLayout, KVReceiver, LayerReceived, TransferDone, TransferEvent, TransferFailed
from kvtransfer.blocks import scatter_parts
from kvtransfer.common import (
    Arrival,
    Control,
    DropLog,
    Fence,
    PeerFailed,
    PendingTransfer,
    WakePipe,
    check_block_ids,
    check_caches,
    check_request_id,
    resolve_endpoint,
)
from kvtransfer.receiver_io import Peer, ReceiverIO
from tandem.protocol import security

log = structlog.get_logger(__name__)


class BaseReceiver(ReceiverIO, KVReceiver):
    connector_name: ClassVar[str]
    default_bind: ClassVar[str] = "tcp://127.0.0.1:*"
    write_fence: ClassVar[bool] = False  # True when senders write D's memory directly (shm)
    MAX_PEERS: ClassVar[int] = 64
    FENCE_TIMEOUT_S: ClassVar[float] = 5.0

    def __init__(
        self, layout: CacheLayout, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None,
        bind: str | None = None, *, timeout_s: float = 30.0,
    ) -> None:
        self.layout = layout
        self.num_blocks = check_caches(layout, kv_caches, kv_scales)
        self.kv_caches, self.kv_scales = list(kv_caches), None if kv_scales is None else list(kv_scales)
        self.ops = get_ops(kv_caches[0].device)
        self._timeout_s = timeout_s
        self._requests: dict[str, PendingTransfer] = {}
        self._fences: dict[str, Fence] = {}
        self._events: list[TransferEvent] = []
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        self.peers: dict[bytes, Peer] = {}
        self._peers_lock = threading.Lock()
        self.drops = DropLog(log)
        self._ctx = zmq.Context()
        self._sock = security.server(self._ctx.socket(zmq.ROUTER))
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(bind or self.default_bind)
        except zmq.ZMQError as exc:
            self._sock.close()
            security.release(self._ctx)
            self._ctx.term()
            raise ValueError(f"cannot bind KV receiver to {bind or self.default_bind!r}: {exc}") from exc
        self._address = resolve_endpoint(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._wake = WakePipe()
        # Readable once a transfer's end waits in the inbox: a worker blocked in its own poller wakes for
        # P's `done` at once instead of at its next timer tick (up to 2 ms of TTFT, measured).
        self._ready = WakePipe()
        self._stop = threading.Event()
        self._setup()
        self._thread = threading.Thread(target=self._io_loop, name=f"kv-recv-{self.connector_name}", daemon=True)
        self._thread.start()

    # ---- connector hooks -------------------------------------------------------------------------
    def _setup(self) -> None:
        """Runs before the I/O thread starts."""

    def _accept_peer(self, peer: bytes, hello: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """Handshake accepted: (extra for hello_ok, per-peer state). ValueError refuses the sender."""
        return {}, None

    def _on_kv(self, peer: bytes, info: Peer, header: wire.KVHeader, frames: list[zmq.Frame], t_ns: int) -> None:
        """I/O thread: make the payload readable and `self._inbox.put(Arrival(...))` (or drop it)."""
        raise NotImplementedError

    def _drop_peer(self, info: Peer) -> None:
        """A peer re-handshook or the receiver closes."""

    # ---- public API (caller thread) --------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._address

    def expect(self, request_id: str, dest_block_ids: list[int], timeout_s: float | None = None) -> None:
        check_request_id(request_id)
        if request_id in self._requests or request_id in self._fences:
            raise ValueError(f"request {request_id!r} is already expected (or still being cancelled)")
        ids = check_block_ids(dest_block_ids, self.num_blocks, "dest_block_ids")
        timeout = self._timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        self._requests[request_id] = PendingTransfer(
            ids, frozenset(ids), int(timeout * 1e9), time.monotonic_ns(), [set() for _ in range(self.layout.num_layers)]
        )

    @property
    def ready_fd(self) -> int:
        return self._ready.rfd

    def _notify(self, item: Any) -> None:
        """I/O thread: hand a transfer's end (done, cancel, a failed peer) to poll() and wake its caller."""
        self._inbox.put(item)
        self._ready.wake()

    def _take_notes(self) -> list[Any]:
        """Caller thread: empty the ready fd (before the inbox is read: WakePipe's rule). A connector whose
        senders write to that fd themselves (shm) returns their messages, as inbox items."""
        self._ready.drain()
        return []

    def poll(self, timeout_ms: int = 0) -> list[TransferEvent]:
        items: list[Any] = self._take_notes()
        try:
            wait = timeout_ms > 0 and not self._events and not items
            items.append(self._inbox.get(timeout=timeout_ms / 1000) if wait else self._inbox.get_nowait())
            while len(items) < 4096:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        for item in items:
            try:
                self._handle(item)
            except Exception as exc:  # a bug handling one message must not take D down
                log.exception("kv_receiver_item_failed", error=str(exc))
        self._check_timeouts(time.monotonic_ns())
        events, self._events = self._events, []
        return events

    def cancel(self, request_id: str) -> None:
        if request_id in self._requests:
            self._retire(request_id, "cancelled", fence=True)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.wake()
        self._thread.join(timeout=5)
        with self._peers_lock:
            for info in {id(i): i for i in self.peers.values()}.values():
                self._drop_peer(info)
            self.peers.clear()
        self._sock.close(linger=0)
        security.release(self._ctx)
        self._ctx.term()
        self._wake.close()
        self._ready.close()
        if self._address.startswith("ipc://"):  # we bound it, so the socket file is ours to remove
            try:
                os.unlink(self._address[len("ipc://"):])
            except OSError:
                pass

    # ---- caller-thread bookkeeping ---------------------------------------------------------------
    def _handle(self, item: Any) -> None:
        if isinstance(item, Arrival):
            self._on_arrival(item)
        elif isinstance(item, PeerFailed):
            for rid, req in list(self._requests.items()):
                if req.peer == item.peer:
                    self._retire(rid, f"sender failed: {item.reason}", fence=False)
            for rid in list(self._fences):
                self._fence_ack(rid, item.peer)
        elif item.msg["type"] == "done":
            self._on_done(item)
        elif item.msg["type"] == "cancel":
            req = self._requests.get(item.msg["request_id"])
            if req is not None and req.peer in (None, item.peer):
                self._retire(item.msg["request_id"], "cancelled by sender", fence=False)
        elif item.msg["type"] == "cancel_ack":
            self._fence_ack(item.msg["request_id"], item.peer)

    def _on_arrival(self, a: Arrival) -> None:
        h = a.header
        req = self._requests.get(h.request_id)
        if req is None:
            self.drops("unexpected_request", request_id=h.request_id[:64])
            return
        if req.peer not in (None, a.peer):
            self.drops("second_sender", request_id=h.request_id)
            return
        if not req.dest_set.issuperset(h.dest_block_ids):
            self.drops("blocks_not_expected", request_id=h.request_id, layer=h.layer)
            return
        req.peer = a.peer
        if a.error is not None:
            self._retire(h.request_id, f"layer {h.layer}: {a.error}", fence=True)
            return
        if a.data is not None:
            scatter_parts(self.ops, self.kv_caches[h.layer], h.dest_block_ids, a.data)
            if a.scale is not None and self.kv_scales is not None:
                scatter_parts(self.ops, self.kv_scales[h.layer], h.dest_block_ids, a.scale)
        req.messages += 1
        req.nbytes += h.nbytes
        for layer in h.layers:
            req.covered[layer].update(h.dest_block_ids)
            self._events.append(LayerReceived(h.request_id, layer, a.t_ns))
        req.last_ns = time.monotonic_ns()
        self._try_complete(h.request_id, req)

    def _on_done(self, c: Control) -> None:
        rid = c.msg["request_id"]
        req = self._requests.get(rid)
        if req is None or req.peer not in (None, c.peer):
            self._send_ack(c.peer, wire.encode("done_ack", request_id=rid, ok=False,
                                           reason="request not expected here (never, cancelled or timed out)"))
            return
        req.peer, req.done, req.last_ns = c.peer, (c.msg["messages"], c.msg["bytes"]), time.monotonic_ns()
        req.result = c.msg["result"]
        self._try_complete(rid, req)

    def _try_complete(self, rid: str, req: PendingTransfer) -> None:
        if req.done is None or req.messages < req.done[0]:
            return  # torch_dist payloads may trail the done message
        reason = req.problem()
        del self._requests[rid]
        if reason:
            self._events.append(TransferFailed(rid, reason))
        else:
            self._events.append(TransferDone(rid, req.nbytes, req.result))
        if req.peer is not None:  # always set once a done arrived; keeps the type checker honest
            self._send_ack(req.peer, wire.encode("done_ack", request_id=rid, ok=not reason, reason=reason))

    def _retire(self, rid: str, reason: str, fence: bool) -> None:
        """End an unfinished request: tell every sender to stop, report once writes are fenced."""
        self._requests.pop(rid, None)
        with self._peers_lock:
            peers = {info.identity for info in self.peers.values()}
            live = {info.identity for info in self.peers.values() if not info.stale}
        for p in peers:
            self._send(p, wire.encode("cancel", request_id=rid))
        if fence and self.write_fence and live:
            self._fences[rid] = Fence(reason, live, time.monotonic_ns() + int(self.FENCE_TIMEOUT_S * 1e9))
        else:
            self._events.append(TransferFailed(rid, reason))

    def _fence_ack(self, rid: str, peer: bytes) -> None:
        fence = self._fences.get(rid)
        if fence is not None:
            fence.waiting.discard(peer)
            if not fence.waiting:
                del self._fences[rid]
                self._events.append(TransferFailed(rid, fence.reason))

    def _check_timeouts(self, now: int) -> None:
        for rid, req in list(self._requests.items()):
            if now - req.last_ns > req.timeout_ns:
                done = sum(len(c) == len(req.dest_ids) for c in req.covered)
                self._retire(rid, f"timed out: nothing for {req.timeout_ns / 1e9:g}s "
                                  f"({done}/{len(req.covered)} layers complete)", fence=True)
        for rid, fence in list(self._fences.items()):
            if now > fence.deadline_ns:
                with self._peers_lock:
                    for p in fence.waiting:  # probably dead; don't wait for it again until it speaks
                        if p in self.peers:
                            self.peers[p].stale = True
                del self._fences[rid]
                self._events.append(TransferFailed(rid, fence.reason))

    def _send(self, peer: bytes, data: bytes) -> None:
        self._outbox.put([peer, data])
        self._wake.wake()

    def _send_ack(self, peer: bytes, data: bytes) -> None:
        """A done_ack (shm: straight to the sender's note socket when it has one)."""
        self._send(peer, data)
