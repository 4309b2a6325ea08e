"""The `zmq` connector: KV blocks as ZMQ multipart `[msgpack header, data..., (scales...)]` over tcp:// or ipc://.

The payload is one frame per run of blocks, in `dest_block_ids` order: the data frames, then (int8/fp8)
as many scale frames covering the same runs. A sender that may borrow P's blocks (`send_layer(...,
borrow=True)`, CPU cache) hands ZMQ each run of consecutive source blocks as it lies in the cache, no
copy (measured: the packing copy cost a third of a 16 MiB transfer on two busy cores); otherwise it
packs the layer into one fresh buffer (one frame). ZMQ sends either without copying (`copy=False`);
the receiver views the arrived frames as tensors (again without copying) and scatters them into D's
blocks in poll().
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import zmq

from kvtransfer import wire
from kvtransfer.base import CacheLayout, KVConnector
from kvtransfer.blocks import block_runs, gather
from kvtransfer.common import Arrival
from kvtransfer.malloc_tuning import keep_freed_memory
from kvtransfer.receiver import BaseReceiver, Peer
from kvtransfer.sender import BaseSender, Outgoing


def frame_tensor(frame: zmq.Frame, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A received frame as a tensor sharing its memory (the tensor keeps the frame alive)."""
    with warnings.catch_warnings():  # frames are read-only; we only ever read them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(frame.buffer, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def pack_layer(
    sender: BaseSender, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, src: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """P's blocks `src` as contiguous CPU buffers (data, scales): the copy that frees P's blocks."""
    data = gather(sender.ops, kv_cache, src)
    scale = gather(sender.ops, kv_scale, src) if kv_scale is not None else None
    if data.device.type != "cpu":
        data = data.cpu()
        scale = scale.cpu() if scale is not None else None
    return data, scale


MAX_BORROWED_RUNS = 64  # more runs than this (scattered blocks): one packed copy beats many small frames


def borrowed_parts(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, src: list[int]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """P's blocks `src` as views of runs of consecutive blocks (data, scales), or None where they
    cannot be sent in place (not a contiguous CPU cache, or too fragmented)."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous() or (
            kv_scale is not None and not kv_scale.is_contiguous()):
        return None
    runs = block_runs(src, src)
    if len(runs) > MAX_BORROWED_RUNS:
        return None
    data = [kv_cache[s:s + n] for _, s, n in runs]
    scale = [] if kv_scale is None else [kv_scale[s:s + n] for _, s, n in runs]
    return data, scale


class ZmqSender(BaseSender):
    connector_name = "zmq"

    def _pack(self, state: Any, request_id: str, layer: int, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None,
              src: list[int], dest: list[int], borrow: bool) -> Outgoing:
        parts = borrowed_parts(kv_cache, kv_scale, src) if borrow else None
        if parts is None:
            packed, packed_scale = pack_layer(self, kv_cache, kv_scale, src)
            parts = [packed], [] if packed_scale is None else [packed_scale]
        data, scale = parts
        crc = wire.payload_crc(*data, *scale) if self.checksum else None
        header = wire.kv_header(self.layout, request_id, layer, dest, checksum=crc)
        return Outgoing(request_id, header, frames=[wire.as_bytes(t) for t in data + scale],
                        nbytes=sum(t.nbytes for t in data + scale))


class ZmqReceiver(BaseReceiver):
    connector_name = "zmq"

    def _on_kv(self, peer: bytes, info: Peer, header: wire.KVHeader, frames: list[zmq.Frame], t_ns: int) -> None:
        layout, quantized = self.layout, bool(header.scale_nbytes)
        half = len(frames) // 2 if quantized else len(frames)
        sizes = [len(f.buffer) for f in frames]
        counts = [size // layout.block_nbytes for size in sizes[:half]]
        if not frames or (quantized and len(frames) % 2) or sum(sizes[:half]) != header.data_nbytes or any(
                c == 0 or size != c * layout.block_nbytes for c, size in zip(counts, sizes)) or (
                quantized and sizes[half:] != [c * layout.scale_block_nbytes for c in counts]):
            raise wire.ProtocolError(f"kv: {len(frames)} payload frames of {sizes[:4]} bytes do not split "
                                     f"{header.data_nbytes} + {header.scale_nbytes} bytes into runs of blocks")
        data = [frame_tensor(f, layout.torch_kv_dtype, (c, *layout.block_shape)) for f, c in zip(frames, counts)]
        scale = [frame_tensor(f, torch.float32, (c, *layout.scale_block_shape))
                 for f, c in zip(frames[half:], counts)] if quantized else None
        error = None
        if header.checksum is not None and wire.payload_crc(*data, *(scale or [])) != header.checksum:
            error = "checksum mismatch"
        self._inbox.put(Arrival(peer, header, data, scale, t_ns, error))


class ZmqConnector(KVConnector):
    """tcp:// across hosts, ipc:// on one host; the receiver binds tcp://127.0.0.1:* unless told."""

    name = "zmq"

    def make_receiver(self, layout: CacheLayout, kv_caches: list[torch.Tensor],
                      kv_scales: list[torch.Tensor] | None, bind: str | None = None) -> ZmqReceiver:
        keep_freed_memory()  # every arriving layer is a fresh multi-MiB ZMQ message
        return ZmqReceiver(layout, kv_caches, kv_scales, bind, timeout_s=self.timeout_s)

    def make_sender(self, layout: CacheLayout, device: torch.device | str = "cpu") -> ZmqSender:
        keep_freed_memory()  # every layer is packed into a fresh multi-MiB buffer
        return ZmqSender(layout, device, checksum=self.checksum)
