"""The `zmq` connector: KV blocks as ZMQ multipart `[msgpack header, data, (scales)]` over tcp:// or ipc://.

The sender packs a layer's blocks into one contiguous buffer (a second for int8/fp8 scales) and
hands it to ZMQ without copying (`copy=False`); the receiver views the arrived frames as tensors
(again without copying) and scatters them into D's blocks in poll().
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import zmq

from kvtransfer import wire
from kvtransfer.base import CacheLayout, KVConnector
from kvtransfer.blocks import gather
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


class ZmqSender(BaseSender):
    connector_name = "zmq"

    def _pack(self, state: Any, request_id: str, layer: int, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None,
              src: list[int], dest: list[int]) -> Outgoing:
        data, scale = pack_layer(self, kv_cache, kv_scale, src)
        crc = wire.payload_crc(data, scale) if self.checksum else None
        frames = [wire.as_bytes(data)] + ([wire.as_bytes(scale)] if scale is not None else [])
        nbytes = data.nbytes + (scale.nbytes if scale is not None else 0)
        header = wire.kv_header(self.layout, request_id, layer, dest, checksum=crc)
        return Outgoing(request_id, header, frames=frames, nbytes=nbytes)


class ZmqReceiver(BaseReceiver):
    connector_name = "zmq"

    def _on_kv(self, peer: bytes, info: Peer, header: wire.KVHeader, frames: list[zmq.Frame], t_ns: int) -> None:
        sizes = [header.data_nbytes] + ([header.scale_nbytes] if header.scale_nbytes else [])
        got = [len(f.buffer) for f in frames]
        if got != sizes:
            raise wire.ProtocolError(f"kv: payload frames of {got[:4]} bytes, header says {sizes}")
        n = len(header.dest_block_ids)
        data = frame_tensor(frames[0], self.layout.torch_kv_dtype, (n, *self.layout.block_shape))
        scale = frame_tensor(frames[1], torch.float32, (n, *self.layout.scale_block_shape)) if len(frames) > 1 else None
        error = None
        if header.checksum is not None and wire.payload_crc(data, scale) != header.checksum:
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
