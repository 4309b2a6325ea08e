"""The router's ZMQ sockets, on the asyncio loop (zmq.asyncio).

- WorkerLinks: one DEALER per worker control address. Requests (`add_request`, `abort`, `stats`)
  go out on it; the worker answers on the same socket, and a reader task hands every valid message
  to `on_message(address, msg)`. One socket per worker (not per request) keeps the router's socket
  count at the cluster size however many requests are in flight.
- ListenSocket: the ROUTER workers register and heartbeat to.

Frames are validated by `messages.decode`; a bad one is logged and dropped, never raised.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, cast

import structlog
import zmq
import zmq.asyncio

from tandem.protocol import messages, security
from tandem.protocol.channel import dealer_socket
from tandem.protocol.messages import ProtocolError

log = structlog.get_logger(__name__)

# How long a closed link still tries to deliver what it queued (e.g. the `abort`s sent to a worker
# that was just declared lost: if it is only slow, it should stop computing for nobody).
CLOSE_LINGER_MS = 200


def _send_now(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """Non-blocking send; raises ConnectionError if the socket will not take it now."""
    fut = cast("asyncio.Future[Any]", sock.send_multipart(frames, zmq.NOBLOCK))
    # With NOBLOCK, zmq.asyncio completes the future immediately (success or zmq.Again).
    if fut.done() and fut.exception() is not None:
        raise ConnectionError(f"socket not accepting messages: {fut.exception()}")


class WorkerLinks:
    def __init__(self, ctx: zmq.asyncio.Context, on_message: Callable[[str, dict[str, Any]], None]) -> None:
        self.ctx = ctx
        self.on_message = on_message
        self.socks: dict[str, zmq.asyncio.Socket] = {}
        self.readers: dict[str, asyncio.Task] = {}

    def send(self, address: str, msg_type: str, **fields: Any) -> None:
        try:
            _send_now(self._get(address), [messages.encode(msg_type, **fields)])
        except ConnectionError as exc:
            raise ConnectionError(f"worker {address}: {exc}") from None

    def try_send(self, address: str, msg_type: str, **fields: Any) -> bool:
        try:
            self.send(address, msg_type, **fields)
            return True
        except ConnectionError:
            return False

    def _get(self, address: str) -> zmq.asyncio.Socket:
        sock = self.socks.get(address)
        if sock is None:
            sock = self.socks[address] = cast(zmq.asyncio.Socket, dealer_socket(self.ctx, address))
            self.readers[address] = asyncio.get_running_loop().create_task(self._read(address, sock))
        return sock

    async def _read(self, address: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frame = await sock.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                msg = messages.decode(frame)
            except ProtocolError as exc:
                log.warning("bad message from worker", worker=address, error=str(exc))
                continue
            try:
                self.on_message(address, msg)
            except Exception:  # one bad message must not stop the link
                log.exception("handling a worker message failed", worker=address, type=msg.get("type"))

    def drop(self, address: str) -> None:
        """Close the link to a worker that left (what it queued gets CLOSE_LINGER_MS to go out)."""
        task = self.readers.pop(address, None)
        if task is not None:
            task.cancel()
        sock = self.socks.pop(address, None)
        if sock is not None:
            sock.close(linger=CLOSE_LINGER_MS)

    def close(self) -> None:
        for address in list(self.socks):
            self.drop(address)


class ListenSocket:
    """ROUTER for worker registration; `handler(msg, identity)` returns an error text to answer with, or None."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.sock = security.server(ctx.socket(zmq.ROUTER))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def serve(self, handler: Callable[[dict[str, Any], bytes], str | None]) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                continue
            identity, frame = frames
            try:
                msg = messages.decode(frame)
            except ProtocolError as exc:
                log.warning("bad registration message", error=str(exc))
                self._reply(identity, None, str(exc))
                continue
            try:
                error = handler(msg, identity)
            except Exception as exc:
                log.exception("registration handling failed")
                error = f"router error: {exc}"
            if error is not None:
                self._reply(identity, msg.get("id"), error)

    def refuse(self, identity: bytes, message: str) -> None:
        """Tell a registered worker, after the fact, that its registration was refused."""
        self._reply(identity, None, message)

    def _reply(self, identity: bytes, rid: Any, message: str) -> None:
        try:
            _send_now(self.sock, [identity, messages.encode("error", id=rid if isinstance(rid, str) else None,
                                                            message=message)])
        except ConnectionError:
            pass  # the worker is gone; it will register again when it comes back

    def close(self) -> None:
        self.sock.close(0)
