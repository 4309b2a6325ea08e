"""The `shm` connector (same host): P writes straight into D's KV cache, which lives in shared memory.

D allocates its caches with `allocate_shared_kv_caches` (or `ShmConnector.allocate_kv_caches`): one
file in /dev/shm (kvtransfer/shm_segment.py), mapped for the worker's lifetime, so a transfer
allocates nothing and moves each byte once (P's block -> D's block, with streaming stores:
kvtransfer/blocks.py copy_blocks). The handshake tells P the
file and the per-layer offsets; a small `kv` notification over ZMQ says which blocks of which layers
are written — held by P until the request's `done` and merged into one message for all layers
(BaseSender.defer_notifications) and sent with the `done` as a datagram straight to D's caller thread,
which acknowledges the same way (kvtransfer/shm_notes.py); over ZMQ only when that way is closed.
Because P writes D's memory itself, cancelling is fenced: D reports the cancel only after P confirms
(under the lock its writes take) that it writes nothing more for that request.
"""

from __future__ import annotations

import os
import select
import tempfile
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from kvtransfer import wire
from kvtransfer.base import CacheLayout, KVConnector
from kvtransfer.blocks import copy_blocks, gather
from kvtransfer.common import Arrival, Control, check_caches
from kvtransfer.receiver import BaseReceiver, Peer, TransferEvent
from kvtransfer.sender import BaseSender, Outgoing, _Conn
from kvtransfer.shm_notes import MAX_FRAMES, NoteSocket, pack_notes, unpack_notes, usable_peer_path
from kvtransfer.shm_segment import (  # noqa: F401  (re-exported: the segment's API under the connector's name)
    FILE_PREFIX,
    SEGMENTS,
    SHM_DIR,
    SharedKVHandle,
    allocate_shared_kv_caches,
    reap_orphaned_segments,
    views,
)


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


@dataclass(slots=True)
class _Mapped:
    """D's cache as mapped into P."""

    buffer: torch.Tensor
    caches: list[torch.Tensor]
    scales: list[torch.Tensor] | None
    notes: str | None  # D's note socket, if reachable from here


class ShmSender(BaseSender):
    connector_name = "shm"
    defer_notifications = True

    def __init__(self, layout: CacheLayout, device: torch.device | str = "cpu", *, checksum: bool = False) -> None:
        try:
            self._notes: NoteSocket | None = NoteSocket(SHM_DIR, FILE_PREFIX)
        except OSError:  # no shared-memory directory here: everything goes over ZMQ
            self._notes = None
        self._note_receivers: dict[str, str] = {}  # D's note path -> its address (I/O thread reads it)
        self._batch: list[tuple[_Conn, str, Outgoing]] | None = None  # a finish's notes, under the lock
        super().__init__(layout, device, checksum=checksum)

    def _hello_extra(self) -> dict[str, Any] | None:
        return None if self._notes is None else {"notes": self._notes.path}

    def _extra_fds(self) -> list[int]:
        return [] if self._notes is None else [self._notes.rfd]

    def _on_fd_ready(self, fd: int) -> None:
        """I/O thread: D's acknowledgements, from the note socket of a receiver we handshook with."""
        assert self._notes is not None
        for data, path in self._notes.drain():
            address = self._note_receivers.get(path)
            if address is None:
                self._drops("note_from_unknown_receiver", path=path[:120])
                continue
            try:
                msgs = [wire.decode(frame) for frame in unpack_notes(data)]
            except wire.ProtocolError as exc:
                self._drops("malformed_note", detail=str(exc)[:200])
                continue
            for msg in msgs:
                if msg["type"] != "done_ack":
                    self._drops("unexpected_note", type=msg["type"])
                else:
                    self._on_done_ack(msg, address)

    def finish_async(self, request_id: str, address: str | None = None,
                     result: dict[str, Any] | None = None) -> Future:
        # The held notifications and the done leave together, as one datagram: D wakes once, with everything.
        with self._lock:
            self._batch = []
            try:
                fut = super().finish_async(request_id, address, result)
            finally:
                batch, self._batch = self._batch, None
            if batch:
                self._send_notes(batch)
        return fut

    def _send(self, conn: _Conn, address: str, item: Outgoing) -> None:
        if conn.state.notes is not None and self._notes is not None and item.kind in ("kv", "done") \
                and not item.frames:
            if self._batch is not None:
                self._batch.append((conn, address, item))
            else:
                self._send_notes([(conn, address, item)])
            return
        super()._send(conn, address, item)

    def _send_notes(self, items: list[tuple[_Conn, str, Outgoing]]) -> None:
        """Caller holds the lock: one receiver's notes as one datagram, or (its socket unreachable or
        full, the notes too big or too many: a checksummed 64-layer model's) over ZMQ, in order."""
        conn = items[0][0]
        if len(items) < MAX_FRAMES and self._notes is not None and self._notes.send(
                pack_notes([item.header for _, _, item in items]), conn.state.notes):
            with self._book:
                self.stats.bytes_sent += sum(item.nbytes for _, _, item in items)
            return
        for conn, address, item in items:
            super()._send(conn, address, item)

    def _close_state(self, state: _Mapped) -> None:
        if state.notes is not None:
            self._note_receivers.pop(state.notes, None)

    def close(self) -> None:
        super().close()
        if self._notes is not None:
            self._notes.close()

    def _on_connected(self, address: str, extra: dict[str, Any]) -> _Mapped:
        path, nbytes, num_blocks = extra.get("path"), extra.get("nbytes"), extra.get("num_blocks")
        layer_offsets, scale_offsets = extra.get("layer_offsets"), extra.get("scale_offsets")
        if not (isinstance(path, str) and os.path.basename(path).startswith(FILE_PREFIX)
                and isinstance(nbytes, int) and isinstance(num_blocks, int) and num_blocks > 0
                and isinstance(layer_offsets, list) and len(layer_offsets) == self.layout.num_layers
                and (scale_offsets is None) != self.layout.is_quantized):
            raise ValueError(f"receiver sent an unusable shm description: {str(extra)[:200]}")
        if not os.path.exists(path) or os.path.getsize(path) != nbytes:
            raise ValueError(f"shared KV segment {path} is missing or has the wrong size: is the receiver "
                             f"on this host (the shm connector only works within one host)?")
        buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        caches, scales = views(buffer, self.layout, num_blocks, layer_offsets, scale_offsets)
        notes = usable_peer_path(extra.get("notes"), os.path.dirname(path), FILE_PREFIX)
        if notes is not None:
            self._note_receivers[notes] = address
        return _Mapped(buffer, caches, scales, notes)

    def _pack(self, state: _Mapped, request_id: str, layer: int, kv_cache: torch.Tensor,
              kv_scale: torch.Tensor | None, src: list[int], dest: list[int], borrow: bool) -> Outgoing:
        num_blocks = state.caches[layer].shape[0]
        if max(dest) >= num_blocks:
            raise ValueError(f"dest_block_ids {max(dest)} out of range: the receiver has {num_blocks} blocks")
        # The one copy: P's blocks into D's, with streaming stores (runs of consecutive ids are one call each).
        copy_blocks(self.ops, state.caches[layer], dest, kv_cache, src, streaming=True)
        nbytes = len(src) * self.layout.block_nbytes
        if kv_scale is not None and state.scales is not None:
            copy_blocks(self.ops, state.scales[layer], dest, kv_scale, src, streaming=True)
            nbytes += len(src) * self.layout.scale_block_nbytes
        if self.checksum:
            crc = wire.payload_crc(gather(self.ops, kv_cache, src).cpu(),
                                   None if kv_scale is None else gather(self.ops, kv_scale, src).cpu())
            return Outgoing(request_id, wire.kv_header(self.layout, request_id, layer, dest, checksum=crc),
                            nbytes=nbytes)
        # Held until the request's done (defer_notifications); the header is written by _merge_held.
        return Outgoing(request_id, b"", nbytes=nbytes, payload_note=(layer, dest))

    def _merge_held(self, held: list[Outgoing]) -> list[Outgoing]:
        """Runs of held notifications for the same blocks become one message naming all their layers
        (a prompt sent in one go: one message for the whole transfer)."""
        out: list[Outgoing] = []
        run: list[Outgoing] = []
        layers: list[int] = []  # the run's layers, in order
        seen: set[int] = set()  # and as a set: a layer seen again starts a new run (one pass, not layers^2)

        def close_run() -> None:
            if run:
                layer, dest = run[0].payload_note
                header = wire.kv_header(self.layout, run[0].request_id, layer, dest,
                                        layers=list(layers) if len(layers) > 1 else None)
                out.append(Outgoing(run[0].request_id, header, nbytes=sum(item.nbytes for item in run)))
                run.clear()
                layers.clear()
                seen.clear()

        for item in held:
            if item.payload_note is None:  # a checksummed notification, complete as it is
                close_run()
                out.append(item)
                continue
            layer, dest = item.payload_note
            if run and (dest != run[0].payload_note[1] or layer in seen):
                close_run()
            run.append(item)
            layers.append(layer)
            seen.add(layer)
        close_run()
        return out


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
