"""The `shm` connector (same host): P writes straight into D's KV cache, which lives in shared memory.

D allocates its caches with `allocate_shared_kv_caches` (or `ShmConnector.allocate_kv_caches`): one
file in /dev/shm (kvtransfer/shm_segment.py), mapped for the worker's lifetime, so a transfer
allocates nothing and moves each byte once (P's block -> D's block, with streaming stores:
kvtransfer/blocks.py copy_blocks). The handshake tells P the
file and the per-layer offsets; a small `kv` notification over ZMQ says which blocks of which layers
are written — held by P until the request's `done` and merged into one message for all layers
(BaseSender.defer_notifications) and sent with the `done` as a datagram straight to D's caller thread,
which acknowledges the same way (kvtransfer/shm_notes.py); over ZMQ only when that way is closed. This file:
D's side (ShmReceiver) and the connector; P's side is kvtransfer/shm_sender.py.
Because P writes D's memory itself, cancelling is fenced: D reports the cancel only after P confirms
(under the lock its writes take) that it writes nothing more for that request.
"""

from __future__ import annotations

import os
import select
import tempfile
import time
import uuid
from typing import Any

import torch
import zmq

from kvtransfer import wire
from kvtransfer.base import CacheLayout, KVConnector
from kvtransfer.blocks import gather
from kvtransfer.common import Arrival, Control, check_caches
from kvtransfer.receiver import BaseReceiver, Peer, TransferEvent
from kvtransfer.shm_notes import NoteSocket, pack_notes, unpack_notes, usable_peer_path
from kvtransfer.shm_segment import (  # noqa: F401  (re-exported: the segment's API under the connector's name)
    FILE_PREFIX,
    SEGMENTS,
    SHM_DIR,
    SharedKVHandle,
    allocate_shared_kv_caches,
    reap_orphaned_segments,
    views,
)
from kvtransfer.shm_sender import ShmSender


class ShmReceiver(BaseReceiver):
    connector_name = "shm"
    write_fence = True

    def __init__(self, layout: CacheLayout, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None,
                 bind: str | None = None, *, timeout_s: float = 30.0) -> None:
        check_caches(layout, kv_caches, kv_scales)
        handle = SEGMENTS.get(kv_caches[0].untyped_storage().data_ptr())
        if handle is None:
            raise ValueError("the shm connector needs D's KV caches in shared memory: allocate them with "
                             "kvtransfer.shm_connector.allocate_shared_kv_caches() or "
                             "ShmConnector.allocate_kv_caches()")
        base = handle.buffer.data_ptr()
        tensors = list(kv_caches) + list(kv_scales or [])
        if any(t.untyped_storage().data_ptr() != base for t in tensors):
            raise ValueError("all kv_caches / kv_scales must come from the same allocate_shared_kv_caches() call")
        self._extra = {
            "path": handle.path, "nbytes": handle.nbytes, "num_blocks": kv_caches[0].shape[0],
            "layer_offsets": [t.data_ptr() - base for t in kv_caches],
            "scale_offsets": None if kv_scales is None else [t.data_ptr() - base for t in kv_scales],
        }
        self._notes_dir = os.path.dirname(handle.path)
        bind = bind or f"ipc://{tempfile.gettempdir()}/{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}.sock"
        super().__init__(layout, kv_caches, kv_scales, bind, timeout_s=timeout_s)

    def _setup(self) -> None:
        # The ready fd becomes the note socket: P's notes and the I/O thread's wakes arrive on one fd.
        try:
            self._notes: NoteSocket | None = NoteSocket(self._notes_dir, FILE_PREFIX)
        except OSError:  # e.g. a segment directory whose path is too long for a socket: all over ZMQ
            self._notes = None
            return
        self._ready.close()
        self._ready = self._notes  # type: ignore[assignment]  # the same rfd / wake / drain / close
        self._waiter = select.poll()  # not select.select: a serving process's fds pass 1024
        self._waiter.register(self._notes.rfd, select.POLLIN)
        self._extra["notes"] = self._notes.path

    def _accept_peer(self, peer: bytes, hello: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        # The peer's state is the path of its note socket (None: acknowledge over ZMQ).
        return self._extra, usable_peer_path((hello.get("extra") or {}).get("notes"), SHM_DIR, FILE_PREFIX)

    def poll(self, timeout_ms: int = 0) -> list[TransferEvent]:
        # Wait on the note socket, not the inbox: the notes arrive there (the I/O thread wakes it too).
        if self._notes is None:
            return super().poll(timeout_ms)
        if timeout_ms > 0 and not self._events and self._inbox.empty():
            self._waiter.poll(timeout_ms)
        return super().poll(0)

    def _take_notes(self) -> list[Any]:
        if self._notes is None:
            return super()._take_notes()
        notes = self._notes.drain()
        if not notes:
            return []
        with self._peers_lock:
            by_path = {info.state: info for info in self.peers.values() if info.state}
        items: list[Any] = []
        for data, path in notes:
            info = by_path.get(path)
            if info is None:
                self.drops("note_from_unknown_sender", path=path[:120])
                continue
            info.stale = False
            try:
                for frame in unpack_notes(data):
                    t_ns = time.monotonic_ns()
                    msg = wire.decode(frame)
                    if msg["type"] == "kv":
                        items.append(self._arrival(info.identity, wire.parse_kv(msg, self.layout), t_ns))
                    elif msg["type"] == "done":
                        items.append(Control(info.identity, msg, t_ns))
                    else:
                        raise wire.ProtocolError(f"note: unexpected {msg['type']} message")
            except wire.ProtocolError as exc:  # what came before the bad frame stands; the rest is dropped
                self.drops(str(exc).split(":")[0][:40], detail=str(exc)[:200])
        return items

    def _send_ack(self, peer: bytes, data: bytes) -> None:
        with self._peers_lock:
            info = self.peers.get(peer)
        if info is None or info.state is None or self._notes is None or not self._notes.send(
                pack_notes([data]), info.state):
            self._send(peer, data)

    def _on_kv(self, peer: bytes, info: Peer, header: wire.KVHeader, frames: list[zmq.Frame], t_ns: int) -> None:
        if frames:
            raise wire.ProtocolError(f"kv: shm notifications carry no payload, got {len(frames)} frames")
        self._notify(self._arrival(peer, header, t_ns))  # wakes a poll() waiting on the note socket

    def _arrival(self, peer: bytes, header: wire.KVHeader, t_ns: int) -> Arrival:
        error = None
        if header.checksum is not None and max(header.dest_block_ids) < self.num_blocks:
            data = gather(self.ops, self.kv_caches[header.layer], header.dest_block_ids)
            scale = None if self.kv_scales is None else gather(self.ops, self.kv_scales[header.layer],
                                                               header.dest_block_ids)
            if wire.payload_crc(data, scale) != header.checksum:
                error = "checksum mismatch"
        return Arrival(peer, header, None, None, t_ns, error)


class ShmConnector(KVConnector):
    """Same host only; D's caches must come from `allocate_kv_caches` (CPU shared memory)."""

    name = "shm"

    def allocate_kv_caches(self, layout: CacheLayout, num_blocks: int, device: torch.device | str = "cpu"
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if torch.device(device).type != "cpu":
            raise ValueError("the shm connector shares host memory; use 'zmq' or 'torch_dist' for GPU caches")
        caches, scales, _ = allocate_shared_kv_caches(layout, num_blocks)
        return caches, scales

    def free_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        handle = SEGMENTS.get(kv_caches[0].untyped_storage().data_ptr()) if kv_caches else None
        if handle is not None:
            handle.close()

    def make_receiver(self, layout: CacheLayout, kv_caches: list[torch.Tensor],
                      kv_scales: list[torch.Tensor] | None, bind: str | None = None) -> ShmReceiver:
        return ShmReceiver(layout, kv_caches, kv_scales, bind, timeout_s=self.timeout_s)

    def make_sender(self, layout: CacheLayout, device: torch.device | str = "cpu") -> ShmSender:
        return ShmSender(layout, device, checksum=self.checksum)
