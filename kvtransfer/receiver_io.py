"""ReceiverIO: the receiver's I/O thread, mixed into BaseReceiver.

It owns the ZMQ ROUTER socket: answers handshakes at once (so P's connect() never waits for D's
step loop), decodes and validates every message against the layout, lets the connector make the
payload readable (`_on_kv`), and hands the result to the caller's thread through the inbox. It
never touches D's cache or the request table. Anything malformed is logged (rate-limited) and
dropped; a sender that has not handshaken is told why with an `error` reply.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog
import zmq

from kvtransfer import wire
from kvtransfer.base import CacheLayout
from kvtransfer.common import Control, DropLog, WakePipe

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Peer:
    sender_id: str
    identity: bytes  # its control socket: replies go here, and it names the sender in the inbox
    data_id: bytes | None = None  # its data socket (kv/done/cancel sent without a thread hop)
    state: Any = None  # connector's per-sender state (torch_dist: the pair's process group)
    stale: bool = False  # missed a fence; not waited for again until it speaks


class ReceiverIO:
    """Attributes below are set up by BaseReceiver.__init__."""

    connector_name: str
    write_fence: bool
    MAX_PEERS: int
    layout: CacheLayout
    peers: dict[bytes, Peer]
    drops: DropLog
    _address: str
    _sock: zmq.Socket
    _wake: WakePipe
    _stop: threading.Event
    _inbox: queue.SimpleQueue
    _outbox: queue.SimpleQueue
    _peers_lock: threading.Lock

    def _accept_peer(self, peer: bytes, hello: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        raise NotImplementedError

    def _on_kv(self, peer: bytes, info: Peer, header: wire.KVHeader, frames: list[zmq.Frame], t_ns: int) -> None:
        raise NotImplementedError

    def _drop_peer(self, info: Peer) -> None:
        raise NotImplementedError

    def _notify(self, item: Any) -> None:
        raise NotImplementedError

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake.rfd, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(1000))
            if self._wake.rfd in ready:
                self._wake.drain()
            while True:
                try:
                    self._sock.send_multipart(self._outbox.get_nowait(), flags=zmq.NOBLOCK)
                except queue.Empty:
                    break
                except zmq.ZMQError:  # peer gone or its queue full: replies are best effort
                    pass
            for _ in range(1024 if self._sock in ready else 0):
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._dispatch(frames)
                except Exception as exc:  # never let one message kill the I/O thread
                    log.exception("kv_dispatch_failed", error=str(exc))

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        t_ns = time.monotonic_ns()
        peer = frames[0].bytes
        with self._peers_lock:
            info = self.peers.get(peer)
        if info is not None:
            peer = info.identity  # a sender's data socket speaks for it
        try:
            if len(frames) < 2:
                raise wire.ProtocolError("no header frame")
            msg = wire.decode(frames[1].buffer)
            if msg["type"] == "hello":
                self._reply_now(peer, self._handshake(peer, msg))
                return
            if info is None:
                raise wire.ProtocolError(f"{msg['type']} from a sender that has not handshaken")
            info.stale = False
            if msg["type"] == "kv":
                header = wire.parse_kv(msg, self.layout)
                if len(header.layers) > 1 and not self.write_fence:  # only where P writes D's memory itself
                    raise wire.ProtocolError(f"kv: one message for several layers, but a {self.connector_name!r} "
                                             "receiver takes each layer's blocks in its own message")
                self._on_kv(peer, info, header, frames[2:], t_ns)
            elif msg["type"] in ("done", "cancel", "cancel_ack") and len(frames) == 2:
                self._notify(Control(peer, msg, t_ns))
            else:
                raise wire.ProtocolError(f"unexpected {msg['type']} message with {len(frames) - 2} payload frames")
        except wire.ProtocolError as exc:
            self.drops(str(exc).split(":")[0][:40], detail=str(exc)[:200])
            if info is None:  # a sender that never handshook (or a bad handshake) is told why
                self._reply_now(peer, wire.encode("kv_error", reason=str(exc)))

    def _handshake(self, peer: bytes, msg: dict[str, Any]) -> bytes:
        if msg["connector"] != self.connector_name:
            return wire.encode("kv_error", reason=f"connector mismatch: sender speaks {msg['connector'][:40]!r}, "
                                               f"receiver at {self._address} is {self.connector_name!r}")
        try:
            theirs = CacheLayout.from_dict(msg["layout"])
        except (ValueError, TypeError) as exc:
            return wire.encode("kv_error", reason=f"bad layout in handshake: {exc}")
        diffs = self.layout.mismatches(theirs, "receiver", "sender")
        if diffs:
            return wire.encode("kv_error", reason="KV cache layout mismatch: " + "; ".join(diffs))
        data_id = msg["data_id"]
        with self._peers_lock:
            if data_id is not None and data_id in self.peers and self.peers[data_id].identity != peer:
                return wire.encode("kv_error", reason="data_id already belongs to another sender")
            old = self.remove_peer(peer)
            if old is None and len({i.identity for i in self.peers.values()}) >= self.MAX_PEERS:
                return wire.encode("kv_error", reason=f"receiver already has {self.MAX_PEERS} senders")
        if old is not None:
            self._drop_peer(old)
        try:
            extra, state = self._accept_peer(peer, msg)
        except ValueError as exc:
            return wire.encode("kv_error", reason=str(exc))
        info = Peer(msg["sender_id"], peer, data_id, state)
        with self._peers_lock:
            self.peers[peer] = info
            if data_id is not None:
                self.peers[data_id] = info
        log.info("kv_sender_connected", sender_id=msg["sender_id"], connector=self.connector_name)
        return wire.encode("hello_ok", layout=self.layout.to_dict(), extra=extra)

    def remove_peer(self, identity: bytes) -> Peer | None:
        """Caller holds _peers_lock: forget a sender under both its identities."""
        info = self.peers.pop(identity, None)
        if info is not None:
            self.peers.pop(info.identity, None)
            if info.data_id is not None:
                self.peers.pop(info.data_id, None)
        return info

    def _reply_now(self, peer: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([peer, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
