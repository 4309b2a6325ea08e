"""SenderIO: the sender's I/O thread, mixed into BaseSender.

It owns one ZMQ DEALER per receiver (the control socket): sends hello and queued messages without
ever blocking on a slow peer (NOBLOCK, retried on POLLOUT), resolves handshake and finish Futures
from hello_ok / error / done_ack, and honours a receiver's cancel: under the sender lock (so no shm
write is in progress or can start) it marks the request cancelled, then answers cancel_ack.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import zmq

from kvtransfer import wire
from kvtransfer.base import CacheLayout, HandshakeError, SenderStats
from kvtransfer.common import DropLog, WakePipe
from tandem.protocol import security

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Outgoing:
    """One message for the I/O thread: a header plus what the connector sends after it."""

    request_id: str
    header: bytes
    kind: str = "kv"  # kv | done | control (control survives a cancel of its request)
    frames: list[Any] = field(default_factory=list)  # zero-copy buffers after the header (zmq)
    nbytes: int = 0  # payload bytes, for stats
    payload: torch.Tensor | None = None  # torch_dist: the flat buffer sent over the process group
    tag: int | None = None
    payload_note: tuple[int, list[int]] | None = None  # shm: (layer, dest blocks) of a held notification


@dataclass(slots=True)
class Link:
    """The I/O thread's view of one receiver."""

    address: str
    sock: zmq.Socket
    hello: Future | None
    state: Any = None
    pending: deque = field(default_factory=deque)
    want_out: bool = False  # registered for POLLOUT because a send would have blocked


class SenderIO:
    """Attributes below are set up by BaseSender.__init__."""

    connector_name: str
    sender_id: str
    layout: CacheLayout
    stats: SenderStats
    _lock: threading.RLock
    _book: threading.RLock
    _requests: dict
    _finishing: dict[str, Future]
    _finishing_to: dict[str, str]
    _commands: queue.SimpleQueue
    _links: dict[str, Link]
    _drops: DropLog
    _ctx: zmq.Context
    _wake: WakePipe

    def _transmit(self, link: Link, item: Outgoing) -> bool:
        raise NotImplementedError

    def _mark_cancelled(self, request_id: str) -> None:
        raise NotImplementedError

    def _hello_extra(self) -> dict[str, Any] | None:
        """Connector-specific fields of the handshake (shm: the sender's note socket)."""
        return None

    def _extra_fds(self) -> list[int]:
        """Raw fds the I/O thread also polls; `_on_fd_ready(fd)` runs when one is readable."""
        return []

    def _on_fd_ready(self, fd: int) -> None:
        raise NotImplementedError

    def _io_loop(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._wake.rfd, zmq.POLLIN)
        extra_fds = self._extra_fds()
        for fd in extra_fds:
            self._poller.register(fd, zmq.POLLIN)
        running = True
        while running:
            ready = dict(self._poller.poll(1000))
            self._wake.drain()
            for fd in extra_fds:
                if fd in ready:
                    try:
                        self._on_fd_ready(fd)
                    except Exception as exc:  # a bad note must not stop the I/O thread
                        log.exception("kv_sender_fd_error", error=str(exc))
            try:
                while True:
                    running = self._run_command(self._commands.get_nowait()) and running
            except queue.Empty:
                pass
            for link in list(self._links.values()):
                try:
                    if ready.get(link.sock, 0) & zmq.POLLIN:
                        self._receive(link)
                    self._flush(link)
                except Exception as exc:  # keep serving the other receivers
                    log.exception("kv_sender_link_error", address=link.address, error=str(exc))
        for link in self._links.values():
            if link.hello is not None and not link.hello.done():
                link.hello.set_exception(HandshakeError("sender closed"))
        with self._book:
            for fut in list(self._finishing.values()):
                if not fut.done():
                    fut.set_result(False)

    def _run_command(self, cmd: tuple[Any, ...]) -> bool:
        kind, args = cmd[0], cmd[1:]
        if kind == "close":
            return False
        link = self._links.get(args[0])
        if kind == "connect":
            if link is not None:
                self._poller.unregister(link.sock)
                link.sock.close(linger=0)
            sock = security.client(self._ctx.socket(zmq.DEALER))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)  # stable across reconnects
            sock.connect(args[0])
            self._poller.register(sock, zmq.POLLIN)
            link = self._links[args[0]] = Link(args[0], sock, args[1])
            link.pending.append(Outgoing("", wire.encode(
                "hello", connector=self.connector_name, sender_id=self.sender_id, layout=self.layout.to_dict(),
                data_id=args[2], extra=self._hello_extra()), "control"))
        elif link is None:
            log.warning("kv_sender_no_link", command=kind, address=args[0])
        elif kind == "forget":
            self._poller.unregister(link.sock)
            link.sock.close(linger=0)
            del self._links[args[0]]
        elif kind == "ready":
            link.state = args[1]
        elif kind == "send":
            link.pending.append(args[1])
        elif kind == "cancel":
            self._drop_queued(link, args[1])
            link.pending.append(Outgoing(args[1], wire.encode("cancel", request_id=args[1]), "control"))
        return True

    def _on_done_ack(self, msg: dict[str, Any], address: str) -> None:
        """D at `address` answered a finish: only the receiver the request went to resolves it (a stale
        answer from another must not settle a retried request's transfer)."""
        if not msg["ok"]:
            log.warning("kv_transfer_refused", request_id=msg["request_id"], reason=msg["reason"])
        with self._book:  # not _lock: a copy in progress holds that
            fut = self._finishing.get(msg["request_id"])
            if fut is not None and not fut.done() and self._finishing_to.get(msg["request_id"]) == address:
                fut.set_result(msg["ok"])

    def _drop_queued(self, link: Link, request_id: str) -> None:
        link.pending = deque(i for i in link.pending if i.request_id != request_id or i.kind == "control")

    def _flush(self, link: Link) -> None:
        while link.pending:
            item = link.pending[0]
            if not self._transmit(link, item):
                if not link.want_out:  # the peer is slow: retry when the socket can take more
                    self._poller.modify(link.sock, zmq.POLLIN | zmq.POLLOUT)
                    link.want_out = True
                return
            link.pending.popleft()
            if item.nbytes:
                with self._book:
                    self.stats.bytes_sent += item.nbytes
        if link.want_out:
            self._poller.modify(link.sock, zmq.POLLIN)
            link.want_out = False

    def _receive(self, link: Link) -> None:
        while True:
            try:
                frames = link.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frames[0]) if len(frames) == 1 else None
            except wire.ProtocolError as exc:
                self._drops("malformed_reply", address=link.address, detail=str(exc)[:200])
                continue
            kind = msg["type"] if msg else None
            if kind in ("hello_ok", "kv_error") and link.hello is not None and not link.hello.done():
                if kind == "hello_ok":
                    link.hello.set_result(msg)
                else:
                    link.hello.set_exception(HandshakeError(f"{link.address} refused the handshake: {msg['reason']}"))
            elif kind == "done_ack":
                self._on_done_ack(msg, link.address)
            elif kind == "cancel":
                rid = msg["request_id"]
                with self._lock:  # waits out an shm write in progress: after this none starts
                    self._requests.pop(rid, None)
                    self._mark_cancelled(rid)
                self._drop_queued(link, rid)
                link.pending.appendleft(Outgoing(rid, wire.encode("cancel_ack", request_id=rid), "control"))
            else:
                self._drops("unexpected_reply", address=link.address, type=str(kind))
