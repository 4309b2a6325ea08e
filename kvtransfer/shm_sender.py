"""The `shm` connector's prefill side: P maps D's shared-memory cache at the handshake and copies its blocks
straight into D's (streaming stores, kvtransfer/blocks.py), holds the per-layer notifications until the
request's `done`, merges them into one message for all layers and sends it with the `done` as one datagram to
D's note socket (kvtransfer/shm_notes.py; over ZMQ when that way is closed). Its I/O thread reads D's
acknowledgements from P's own note socket.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer import wire
from kvtransfer.base import CacheLayout
from kvtransfer.blocks import copy_blocks, gather
from kvtransfer.sender import BaseSender, Outgoing, _Conn
from kvtransfer.shm_notes import MAX_FRAMES, NoteSocket, pack_notes, unpack_notes, usable_peer_path
from kvtransfer.shm_segment import FILE_PREFIX, SHM_DIR, views


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
