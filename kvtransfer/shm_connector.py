"""The `shm` connector (same host): P writes straight into D's KV cache, which lives in shared memory.

D allocates its caches with `allocate_shared_kv_caches` (or `ShmConnector.allocate_kv_caches`): one
file in /dev/shm, pre-faulted once at start-up and mapped for the worker's lifetime, so a transfer
allocates nothing and moves each byte once (P's block -> D's block, with streaming stores:
kvtransfer/blocks.py copy_blocks). The handshake tells P the
file and the per-layer offsets; a small `kv` notification over ZMQ says which blocks of which layers
are written — held by P until the request's `done` and merged into one message for all layers
(BaseSender.defer_notifications), so D's I/O thread wakes once per transfer, not once per layer.
Because P writes D's memory itself, cancelling is fenced: D reports the cancel only after P confirms
(under the lock its writes take) that it writes nothing more for that request.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from kvtransfer import wire
from kvtransfer.base import CacheLayout, KVConnector
from kvtransfer.blocks import copy_blocks, gather
from kvtransfer.common import Arrival, check_caches
from kvtransfer.receiver import BaseReceiver, Peer
from kvtransfer.sender import BaseSender, Outgoing

SHM_DIR = "/dev/shm"
FILE_PREFIX = "tandem-kv-"
ALIGN = 4096  # each layer's tensor starts on a page


@dataclass(slots=True)
class SharedKVHandle:
    """A shared-memory KV cache segment; close() (or a normal interpreter exit) removes the file.
    Mapped tensors stay valid after close(); only new senders can no longer attach. A process that
    dies without either leaves /dev/shm/tandem-kv-<pid>-* behind."""

    path: str
    nbytes: int
    num_blocks: int
    layer_offsets: list[int]
    scale_offsets: list[int] | None
    buffer: torch.Tensor = field(repr=False)  # the whole mapping, uint8
    _finalizer: Any = field(default=None, repr=False)

    def close(self) -> None:
        _SEGMENTS.pop(self.buffer.data_ptr(), None)
        if self._finalizer is not None:
            self._finalizer()


_SEGMENTS: dict[int, SharedKVHandle] = {}  # base address of the mapping -> handle


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _plan(layout: CacheLayout, num_blocks: int) -> tuple[list[int], list[int] | None, int]:
    """Byte offsets of each layer's cache (and scale) tensor in the segment, and its total size."""
    def aligned(n: int) -> int:
        return (n + ALIGN - 1) // ALIGN * ALIGN
    cache_bytes, scale_bytes = num_blocks * layout.block_nbytes, num_blocks * layout.scale_block_nbytes
    layer_offsets = [i * aligned(cache_bytes) for i in range(layout.num_layers)]
    end = layout.num_layers * aligned(cache_bytes)
    scale_offsets = None
    if layout.is_quantized:
        scale_offsets = [end + i * aligned(scale_bytes) for i in range(layout.num_layers)]
        end += layout.num_layers * aligned(scale_bytes)
    return layer_offsets, scale_offsets, end


def _views(buffer: torch.Tensor, layout: CacheLayout, num_blocks: int, layer_offsets: list[int],
           scale_offsets: list[int] | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    cache_bytes, scale_bytes = num_blocks * layout.block_nbytes, num_blocks * layout.scale_block_nbytes
    if any(o < 0 or o % ALIGN or o + cache_bytes > buffer.numel() for o in layer_offsets) or any(
            o < 0 or o % ALIGN or o + scale_bytes > buffer.numel() for o in scale_offsets or []):
        raise ValueError("shared KV segment offsets fall outside the segment")
    caches = [buffer[o:o + cache_bytes].view(layout.torch_kv_dtype).view(num_blocks, *layout.block_shape)
              for o in layer_offsets]
    scales = None if scale_offsets is None else [
        buffer[o:o + scale_bytes].view(torch.float32).view(num_blocks, *layout.scale_block_shape)
        for o in scale_offsets]
    return caches, scales


def reap_orphaned_segments(directory: str = SHM_DIR) -> list[str]:
    """Remove segments whose owner (the pid in the name) is gone: a decode worker killed with
    SIGKILL cannot remove its own. Run at every allocation, so a restarted worker cleans up after the
    one it replaces. (Each container has its own /dev/shm, so pids are of this pid namespace.)"""
    reaped = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if not name.startswith(FILE_PREFIX):
            continue
        pid = name[len(FILE_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _unlink(os.path.join(directory, name))
            reaped.append(name)
        except PermissionError:
            pass  # alive, someone else's
    return reaped


def allocate_shared_kv_caches(
    layout: CacheLayout, num_blocks: int, directory: str = SHM_DIR
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, SharedKVHandle]:
    """D's per-layer caches (and scales) as views of one pre-faulted shared-memory file."""
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
    if not os.path.isdir(directory):
        raise ValueError(f"shared-memory directory {directory!r} does not exist (Linux: /dev/shm)")
    reap_orphaned_segments(directory)
    layer_offsets, scale_offsets, total = _plan(layout, num_blocks)
    path = os.path.join(directory, f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    buffer.zero_()  # pre-fault every page now rather than inside the first transfers
    handle = SharedKVHandle(path, total, num_blocks, layer_offsets, scale_offsets, buffer)
    handle._finalizer = weakref.finalize(buffer, _unlink, path)  # also runs at interpreter exit
    _SEGMENTS[buffer.data_ptr()] = handle
    caches, scales = _views(buffer, layout, num_blocks, layer_offsets, scale_offsets)
    return caches, scales, handle


class ShmReceiver(BaseReceiver):
    connector_name = "shm"
    write_fence = True

    def __init__(self, layout: CacheLayout, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None,
                 bind: str | None = None, *, timeout_s: float = 30.0) -> None:
        check_caches(layout, kv_caches, kv_scales)
        handle = _SEGMENTS.get(kv_caches[0].untyped_storage().data_ptr())
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
        bind = bind or f"ipc://{tempfile.gettempdir()}/{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}.sock"
        super().__init__(layout, kv_caches, kv_scales, bind, timeout_s=timeout_s)

    def _accept_peer(self, peer: bytes, sender_id: str) -> tuple[dict[str, Any], Any]:
        return self._extra, None

    def _on_kv(self, peer: bytes, info: Peer, header: wire.KVHeader, frames: list[zmq.Frame], t_ns: int) -> None:
        if frames:
            raise wire.ProtocolError(f"kv: shm notifications carry no payload, got {len(frames)} frames")
        error = None
        if header.checksum is not None and max(header.dest_block_ids) < self.num_blocks:
            data = gather(self.ops, self.kv_caches[header.layer], header.dest_block_ids)
            scale = None if self.kv_scales is None else gather(self.ops, self.kv_scales[header.layer],
                                                               header.dest_block_ids)
            if wire.payload_crc(data, scale) != header.checksum:
                error = "checksum mismatch"
        self._inbox.put(Arrival(peer, header, None, None, t_ns, error))


@dataclass(slots=True)
class _Mapped:
    """D's cache as mapped into P."""

    buffer: torch.Tensor
    caches: list[torch.Tensor]
    scales: list[torch.Tensor] | None


class ShmSender(BaseSender):
    connector_name = "shm"
    defer_notifications = True

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
        caches, scales = _views(buffer, self.layout, num_blocks, layer_offsets, scale_offsets)
        return _Mapped(buffer, caches, scales)

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
        handle = _SEGMENTS.get(kv_caches[0].untyped_storage().data_ptr()) if kv_caches else None
        if handle is not None:
            handle.close()

    def make_receiver(self, layout: CacheLayout, kv_caches: list[torch.Tensor],
                      kv_scales: list[torch.Tensor] | None, bind: str | None = None) -> ShmReceiver:
        return ShmReceiver(layout, kv_caches, kv_scales, bind, timeout_s=self.timeout_s)

    def make_sender(self, layout: CacheLayout, device: torch.device | str = "cpu") -> ShmSender:
        return ShmSender(layout, device, checksum=self.checksum)
