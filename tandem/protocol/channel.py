"""ZMQ control channel: a worker's ROUTER socket (ControlServer) and the DEALER sockets it or the
router uses to talk to peers (PeerClients). Frames are validated by `messages.decode`; a bad frame
is answered with an `error` message and never reaches the worker's logic.

PeerClients also notice a peer's death fast: ZMTP heartbeats (answered by the peer's ZMQ I/O
thread, so a busy peer still answers; a killed or stopped one does not) drop the connection after
PEER_HEARTBEAT_TIMEOUT_MS of silence, a killed peer's connection closes at once, and a socket
monitor reports either as `lost()`. A peer restarted at the same address is reconnected by ZMQ.
"""

from __future__ import annotations

from typing import Any, Iterator

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from tandem.protocol import messages, security
from tandem.protocol.messages import ProtocolError

log = structlog.get_logger(__name__)
PEER_HEARTBEAT_IVL_MS = 500
PEER_HEARTBEAT_TIMEOUT_MS = 1500


def dealer_socket(ctx: zmq.Context, address: str, send_hwm: int = 10000) -> zmq.Socket:
    """A DEALER connected to `address` that never lingers on close. The send high-water mark bounds
    what queues for a dead peer: past it, sends fail fast instead of growing memory."""
    sock = security.client(ctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.connect(address)
    return sock


def bind_socket(sock: zmq.Socket, address: str) -> str:
    """Bind and return the concrete endpoint (tcp://host:0 picks a free port)."""
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class ControlServer:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = security.server(ctx.socket(zmq.ROUTER))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = bind_socket(self.sock, address)
        self.bad_frames = 0

    def receive(self) -> Iterator[tuple[bytes, dict[str, Any]]]:
        """Drain what is waiting: yields (identity, valid message)."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.bad_frames += 1
                if frames:
                    self.reply(frames[0], "error", id=None, message="expected exactly one frame per message")
                continue
            identity, frame = frames
            try:
                yield identity, messages.decode(frame)
            except ProtocolError as exc:
                self.bad_frames += 1
                log.warning("bad control message", error=str(exc))
                self.reply(identity, "error", id=None, message=str(exc))

    def reply(self, identity: bytes, msg_type: str, **fields: Any) -> None:
        try:
            self.sock.send_multipart([identity, messages.encode(msg_type, **fields)], zmq.NOBLOCK)
        except zmq.Again:  # peer gone or its queue full: drop rather than block the worker loop
            log.warning("dropped reply", type=msg_type)

    def close(self) -> None:
        self.sock.close(0)


class PeerClients:
    """One DEALER socket per peer control address, created on first use."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.socks: dict[str, zmq.Socket] = {}
        self.monitors: dict[str, zmq.Socket] = {}

    def get(self, address: str) -> zmq.Socket:
        sock = self.socks.get(address)
        if sock is None:
            sock = security.client(self.ctx.socket(zmq.DEALER))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.setsockopt(zmq.HEARTBEAT_IVL, PEER_HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PEER_HEARTBEAT_TIMEOUT_MS)
            self.monitors[address] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            self.socks[address] = sock
        return sock

    def lost(self) -> list[str]:
        """Peers whose connection dropped since the last call (killed, stopped, or unreachable)."""
        gone = []
        for address, mon in self.monitors.items():
            while mon.poll(0):
                if recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED and address not in gone:
                    gone.append(address)
        return gone

    def send(self, address: str, msg_type: str, **fields: Any) -> None:
        try:
            self.get(address).send(messages.encode(msg_type, **fields), zmq.NOBLOCK)
        except zmq.Again:
            raise ConnectionError(f"peer {address} is not accepting messages") from None

    def receive(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Drain replies from every peer: yields (peer address, valid message)."""
        for address, sock in list(self.socks.items()):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    yield address, messages.decode(frame)
                except ProtocolError as exc:
                    log.warning("bad message from peer", peer=address, error=str(exc))

    def register(self, poller: zmq.Poller) -> None:
        for sock in self.socks.values():
            poller.register(sock, zmq.POLLIN)

    def close(self) -> None:
        for address, sock in self.socks.items():
            sock.disable_monitor()
            self.monitors[address].close(0)
            sock.close(0)
        self.socks.clear()
        self.monitors.clear()
