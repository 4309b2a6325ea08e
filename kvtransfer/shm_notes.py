"""Notes: the shm connector's `done` and `done_ack` as Unix datagrams, caller thread to caller thread.

With shm, the blocks are in D's memory once P's copy returns; what is left of a transfer are two small
messages, P's `done` (with the layers' merged `kv` notification) and D's `done_ack`. Over the ZMQ links
each took ~5 thread wake-ups (P's ZMQ I/O thread, D's, D's Python I/O thread, D's caller, and back):
1.1-1.5 ms on a 2-core host, against 16-45 us for a datagram round trip between the same two processes.
So each end binds a Unix datagram socket beside the segment (in its directory, which both ends share
wherever the segment works; mode 0600: only the segment's owner can write to it, as to the segment):
  P's caller -> D's note socket, which is D's ready fd: its step loop wakes and reads it in poll();
  D's caller -> P's note socket, read by P's I/O thread.
Whatever cannot go this way (the peer's socket unreachable, its buffer full, a note above the datagram
limit) goes over ZMQ as before: the receiver counts messages, so order across the two paths does not
matter. A datagram from a path no handshake named is dropped unread.
"""

from __future__ import annotations

import os
import socket
import uuid
import weakref

import msgpack

from tandem.protocol.codec import ProtocolError

MAX_NOTE = 1 << 16  # bigger notes (a prompt of ~10k blocks) take the ZMQ path
MAX_FRAMES = 64
SUFFIX = ".note"


def pack_notes(frames: list[bytes]) -> bytes:
    """One datagram carrying several wire messages (P's merged `kv` notification and its `done`:
    D wakes once, with everything)."""
    return msgpack.packb(frames, use_bin_type=True)


def unpack_notes(data: bytes) -> list[bytes]:
    """The wire messages in a datagram (each still to be decoded and checked), or ProtocolError."""
    try:
        frames = msgpack.unpackb(data, raw=False, max_bin_len=MAX_NOTE, max_array_len=MAX_FRAMES)
    except Exception as exc:  # msgpack's zoo of errors on garbage
        raise ProtocolError(f"note: not a msgpack list of frames ({type(exc).__name__})") from None
    if not isinstance(frames, list) or not frames or not all(isinstance(f, bytes) for f in frames):
        raise ProtocolError("note: not a non-empty list of frames")
    return frames


class NoteSocket:
    """A bound, non-blocking Unix datagram socket that also serves as a WakePipe (rfd / wake / drain):
    a wake is an empty datagram, so one poll covers both the peer's notes and this process's wakes."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.path = os.path.join(directory, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}{SUFFIX}")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(self.path)  # OSError: no such directory, or a path too long for a socket
        except OSError:
            self._sock.close()
            raise
        self._unlink = weakref.finalize(self, _remove, self.path)  # also at a normal exit without close()
        os.chmod(self.path, 0o600)
        self._sock.setblocking(False)
        self._waker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._waker.connect(self.path)  # connected, not by path: wakes still work if the file is removed
        self._waker.setblocking(False)
        self.rfd = self._sock.fileno()
        self._pending = False
        self.sent = 0  # notes that went this way (the rest fell back to ZMQ)

    def send(self, data: bytes, path: str) -> bool:
        """False if it cannot go as a datagram now (the caller sends it the other way)."""
        if len(data) > MAX_NOTE:
            return False
        try:
            self._sock.sendto(data, path)
        except OSError:  # gone, unreachable from here, or its receive buffer full
            return False
        self.sent += 1
        return True

    def wake(self) -> None:
        # WakePipe's rule: callers enqueue, then wake; only the first wake after a drain sends.
        if self._pending:
            return
        self._pending = True
        try:
            self._waker.send(b"")
        except OSError:
            pass

    def drain(self) -> list[tuple[bytes, str]]:
        """Every waiting note as (data, the sender's path); wakes are read and dropped. The socket is
        emptied before the flag is cleared (the order WakePipe.drain explains)."""
        notes = []
        while True:
            try:
                data, sender = self._sock.recvfrom(MAX_NOTE)
            except OSError:  # BlockingIOError when empty; closed while shutting down
                break
            if data:
                notes.append((data, sender if isinstance(sender, str) else ""))
        self._pending = False
        return notes

    def close(self) -> None:
        self._sock.close()
        self._waker.close()
        self._unlink()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def usable_peer_path(path: object, directory: str, prefix: str) -> str | None:
    """The peer's note path from its handshake, if it is one of ours and reachable from here."""
    if not (isinstance(path, str) and os.path.dirname(path) == directory
            and os.path.basename(path).startswith(prefix) and path.endswith(SUFFIX)):
        return None
    return path if os.path.exists(path) else None
