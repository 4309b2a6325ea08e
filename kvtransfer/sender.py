"""BaseSender: the prefill-side machinery every connector shares.

The caller's thread packs (send_layer copies the blocks out of P's cache before returning, so P may
reuse them at once; with `borrow=True` zmq sends straight from them instead) and, for zmq and shm, sends
them itself on a per-receiver data socket; a daemon I/O thread (sender_io.py) owns the control socket
per receiver: handshakes, done_ack, cancel from the receiver, and (torch_dist) the transmissions that block.

Life of a request through a sender:
  1. connect(D) once per receiver: hello/hello_ok, then the connector's `_on_connected` (map D's
     shared memory, build the pair's process group).
  2. send_layer(...) per layer (and chunk): `_pack` -> queued message -> transmitted in order.
  3. finish(id): a `done` with the message and byte counts goes after the data; True once D acks
     that everything arrived intact.
  4. cancel(id) here, or a `cancel` from D: queued messages for it are dropped, nothing more is
     written for it (the lock makes this a fence for shm), D gets a cancel / cancel_ack.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
import torch
import zmq

from kernels import get_ops
from kvtransfer import wire
from kvtransfer.base import CacheLayout, HandshakeError, KVSender, SenderStats
from kvtransfer.common import DropLog, TransferIds, WakePipe, check_cache, check_request_id
from kvtransfer.sender_io import Link, Outgoing, SenderIO
from tandem.protocol import security

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Conn:
    """The caller-thread side of one receiver."""

    state: Any  # the connector's (shm: D's mapped cache; torch_dist: the pair's group)
    data: zmq.Socket | None  # direct_send: kv/done/cancel go here, used only under the sender lock


@dataclass(slots=True)
class _Request:
    address: str
    messages: int = 0
    nbytes: int = 0
    held: list[Outgoing] = field(default_factory=list)  # notifications not yet sent (defer_notifications)
    held_since: float = 0.0  # time.monotonic() of the oldest held one


class BaseSender(SenderIO, KVSender):
    connector_name: ClassVar[str]
    direct_send: ClassVar[bool] = True  # False when transmitting blocks (torch_dist: send().wait())
    # shm: the blocks are in D's memory once _pack returns, and D needs their notifications only to
    # check coverage when the request's done arrives. Sent together just before it, they wake D's I/O
    # thread once per transfer instead of once per layer — on a small host each wake-up took the core
    # P was copying on (~80 us a layer). Held at most HOLD_S, so a long prefill still shows D it lives.
    defer_notifications: ClassVar[bool] = False
    HOLD_S: ClassVar[float] = 0.05
    MAX_CANCELLED: ClassVar[int] = 10_000

    def __init__(self, layout: CacheLayout, device: torch.device | str = "cpu", *, checksum: bool = False) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.ops = get_ops(self.device)
        self.checksum = checksum
        self.stats = SenderStats()
        self.sender_id = uuid.uuid4().hex
        self._lock = threading.RLock()  # requests, cancelled; shm writes (the fence): a layer's copy
        # finish Futures and stats, which D's acks touch on the I/O thread: apart from _lock so an ack
        # never waits out a copy (with one lock, streamed shm transfers lost ~0.4 ms each handing it
        # back and forth). Taken after _lock, never before; Futures resolve under it (reentrant), so their
        # callbacks must not call back into the sender.
        self._book = threading.RLock()
        self._requests: dict[str, _Request] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._finishing: dict[str, Future] = {}
        self._finishing_to: dict[str, str] = {}  # request id -> its receiver, while finishing
        self._connected: dict[str, Any] = {}  # address -> connector state, caller-thread side
        self._ids = TransferIds()
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._links: dict[str, Link] = {}  # I/O thread only
        self._drops = DropLog(log)
        self._ctx = zmq.Context()
        self._wake = WakePipe()
        self._closed = False
        self._thread = threading.Thread(target=self._io_loop, name=f"kv-send-{self.connector_name}", daemon=True)
        self._thread.start()

    # ---- connector hooks -------------------------------------------------------------------------
    def _on_connected(self, address: str, extra: dict[str, Any]) -> Any:
        """Caller thread, after hello_ok: returns per-receiver state; ValueError refuses the receiver."""
        return None

    def _pack(self, state: Any, request_id: str, layer: int, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None,
              src: list[int], dest: list[int], borrow: bool) -> Outgoing:
        """`borrow`: the blocks stay unchanged until the request's finish resolves (send_layer)."""
        raise NotImplementedError

    def _transmit(self, link: Link, item: Outgoing) -> bool:
        """I/O thread: send it; False if the socket would block (retried on POLLOUT)."""
        try:
            link.sock.send_multipart([item.header, *item.frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _close_state(self, state: Any) -> None:
        """Release per-receiver state on close."""

    # ---- public API (caller thread) --------------------------------------------------------------
    def connect(self, address: str, timeout_s: float = 10.0) -> None:
        if address in self._connected:
            return
        fut: Future = Future()
        data_id = uuid.uuid4().bytes if self.direct_send else None
        self._command("connect", address, fut, data_id)
        try:
            msg = fut.result(timeout=timeout_s)
        except FutureTimeout:
            self._command("forget", address)
            raise HandshakeError(f"no handshake answer from {address} within {timeout_s}s: is a "
                                 f"{self.connector_name!r} KV receiver bound there and its process alive?") from None
        except HandshakeError:
            self._command("forget", address)
            raise
        try:
            theirs = CacheLayout.from_dict(msg["layout"])
            diffs = self.layout.mismatches(theirs, "sender", "receiver")
            if diffs:
                raise ValueError("KV cache layout mismatch: " + "; ".join(diffs))
            state = self._on_connected(address, msg["extra"])
        except Exception as exc:  # mismatch, unusable description, or the pair's group failed to form
            self._command("forget", address)
            raise HandshakeError(f"handshake with {address} failed: {exc}") from exc
        data = None
        if data_id is not None:
            data = security.client(self._ctx.socket(zmq.DEALER))
            data.setsockopt(zmq.LINGER, 0)
            data.setsockopt(zmq.SNDHWM, 0)  # frames reference buffers we hold anyway: queue, never block
            data.setsockopt(zmq.ROUTING_ID, data_id)
            data.connect(address)
        self._connected[address] = _Conn(state, data)
        self._command("ready", address, state)

    def send_layer(self, address: str, request_id: str, layer: int, kv_cache: torch.Tensor,
                   kv_scale: torch.Tensor | None, src_block_ids: list[int], dest_block_ids: list[int],
                   borrow: bool = False) -> None:
        if address not in self._connected:
            raise ValueError(f"not connected to {address!r}: call connect() first")
        check_request_id(request_id)
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.layout.num_layers}), got {layer!r}")
        check_cache(self.layout, kv_cache, kv_scale, "kv_cache")
        src, dest = self._ids.check(src_block_ids, dest_block_ids, kv_cache.shape[0])
        with self._lock:
            if request_id in self._cancelled:
                return  # cancelled (here or by the receiver): nothing more goes out for it
            req = self._requests.setdefault(request_id, _Request(address))
            if req.address != address:
                raise ValueError(f"request {request_id!r} already goes to {req.address}, not {address}")
            conn = self._connected[address]
            item = self._pack(conn.state, request_id, layer, kv_cache, kv_scale, src, dest, borrow)
            req.messages += 1
            req.nbytes += item.nbytes
            if not self.defer_notifications:
                self._send(conn, address, item)
                return
            if not req.held:
                req.held_since = time.monotonic()
            req.held.append(item)
            if time.monotonic() - req.held_since > self.HOLD_S:
                self._release_held(conn, req)

    def _release_held(self, conn: _Conn, req: _Request) -> None:
        """Caller holds the lock: send the held notifications in order, merged (`done` counts what is sent)."""
        if not req.held:
            return
        messages = self._merge_held(req.held)
        req.messages -= len(req.held) - len(messages)
        for item in messages:
            self._send(conn, req.address, item)
        req.held.clear()

    def _merge_held(self, held: list[Outgoing]) -> list[Outgoing]:
        """The messages that carry a request's held notifications (shm: one for all layers' blocks)."""
        return held

    def _send(self, conn: _Conn, address: str, item: Outgoing) -> None:
        """Caller holds the lock. Direct: on this thread's data socket (no thread hop, no I/O thread
        woken to compete for the GIL); else via the I/O thread."""
        if conn.data is None:
            self._command("send", address, item)
            return
        conn.data.send_multipart([item.header, *item.frames], copy=False)
        with self._book:
            self.stats.bytes_sent += item.nbytes

    def finish_async(self, request_id: str, address: str | None = None,
                     result: dict[str, Any] | None = None) -> Future:
        fut: Future = Future()
        fut.add_done_callback(self._count_outcome)
        with self._lock:
            if request_id in self._cancelled:
                self._requests.pop(request_id, None)
                fut.set_result(False)
                return fut
            req = self._requests.get(request_id) or _Request(address or "")
            conn = self._connected.get(req.address)
            if conn is None:
                raise ValueError(f"nothing was sent for {request_id!r} and address {address!r} is not connected: "
                                 "pass the receiver's address (after connect()) to finish a request with no blocks")
            self._requests.pop(request_id, None)
            self._release_held(conn, req)
            with self._book:
                self._finishing[request_id] = fut
                self._finishing_to[request_id] = req.address
            fut.add_done_callback(lambda _: self._forget_finishing(request_id, fut))
            done = wire.encode("done", request_id=request_id, messages=req.messages, bytes=req.nbytes,
                               result=result or {})
            self._send(conn, req.address, Outgoing(request_id, done, "done"))  # after the data, same socket
        return fut

    def _count_outcome(self, fut: Future) -> None:
        ok = bool(fut.result())
        with self._book:
            self.stats.transfers += ok
            self.stats.failures += not ok

    def _forget_finishing(self, request_id: str, fut: Future) -> None:
        with self._book:
            if self._finishing.get(request_id) is fut:
                del self._finishing[request_id]
                self._finishing_to.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.pop(request_id, None)
            self._mark_cancelled(request_id)
            conn = None if req is None else self._connected.get(req.address)
            if conn is not None and conn.data is not None:
                conn.data.send_multipart([wire.encode("cancel", request_id=request_id)])
            elif req is not None:
                self._command("cancel", req.address, request_id)

    def disconnect(self, address: str) -> None:
        """Forget a receiver (it restarted at the same address): the next connect() handshakes anew.
        Transfers still in flight to it fail, and their finish Futures resolve to False."""
        with self._lock, self._book:
            conn = self._connected.pop(address, None)
            for rid in [r for r, to in self._finishing_to.items() if to == address]:
                fut = self._finishing.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(False)
        if conn is not None:
            self._close_state(conn.state)
            if conn.data is not None:
                conn.data.close(linger=0)
            self._command("forget", address)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._command("close")
        self._thread.join(timeout=10)
        with self._lock:
            for conn in self._connected.values():
                self._close_state(conn.state)
                if conn.data is not None:
                    conn.data.close(linger=0)
        for link in self._links.values():
            link.sock.close(linger=0)
        security.release(self._ctx)
        self._ctx.term()
        self._wake.close()

    # ---- shared internals ------------------------------------------------------------------------
    def _command(self, *cmd: Any) -> None:
        self._commands.put(cmd)
        self._wake.wake()

    def _mark_cancelled(self, request_id: str) -> None:
        """Caller holds the lock. After this no `_pack` runs for it and finish() answers False."""
        self._cancelled[request_id] = None
        while len(self._cancelled) > self.MAX_CANCELLED:
            self._cancelled.popitem(last=False)
        with self._book:  # resolved under it: an ack on the I/O thread may race to resolve it too
            if (fut := self._finishing.get(request_id)) is not None and not fut.done():
                fut.set_result(False)
