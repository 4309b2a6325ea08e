"""Wire format of the KV connectors: the transfer's message types, their validation against the local
cache layout, payload checksums. Messages go through the one codec (tandem/protocol/codec.py).

Every message is one msgpack map with `type` and `v`; KV data follows the header as raw frames
(zmq), already sits in D's memory (shm), or follows over torch.distributed (torch_dist). Nothing is
ever pickled. `decode` + `parse_kv` reject anything malformed with `ProtocolError`, whose text goes
to the log (and back to the peer for a bad handshake).

    hello       sender -> receiver   connector, sender_id, layout, data_id (identity of its data socket), extra
    hello_ok    receiver -> sender   layout, extra (connector specific: shm segment, store address)
    kv_error    receiver -> sender   reason (the handshake is refused)
    kv          sender -> receiver   request_id, layer, dest_block_ids, dtype, shape, scale_shape, checksum, tag
    done        sender -> receiver   request_id, messages, bytes (what the sender sent for it), result
                                     (a map for the receiver: a prefill worker's first token + logprobs)
    done_ack    receiver -> sender   request_id, ok, reason
    cancel      either way           request_id
    cancel_ack  sender -> receiver   request_id (the sender will write nothing more for it)
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.base import CacheLayout
from tandem.protocol import codec
from tandem.protocol.codec import PROTOCOL_VERSION, Blob, Bool, Count, Id, Ints, Map, ProtocolError, Text, message

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "KV_MESSAGES", "encode", "decode"]
MAX_HEADER_BYTES = 1 << 20  # a header lists block ids; 1 MiB is ~200k blocks, far beyond any request
MAX_TAG = (1 << 31) - 1  # torch.distributed tags are C ints


@message("hello")
class Hello:
    connector: Id
    sender_id: Id
    layout: Map
    data_id: Blob | None
    extra: Map | None = None  # connector specific (shm: the sender's note socket)


@message("hello_ok")
class HelloOk:
    layout: Map
    extra: Map


@message("kv_error")
class KVError:
    reason: Text


@message("kv")
class KV:
    request_id: Id
    layer: Count
    dest_block_ids: Ints
    dtype: Id
    shape: Ints
    scale_shape: Ints | None
    checksum: Count | None = field(default=None, metadata={"max": 0xFFFFFFFF})
    tag: Count | None = field(default=None, metadata={"max": MAX_TAG})
    # Several layers' notification at once (shm: P wrote the same blocks of each into D's memory);
    # `layer` is the first of them. No payload, no checksum.
    layers: Ints | None = None


@message("done")
class Done:
    request_id: Id
    messages: Count
    bytes: Count
    result: Map


@message("done_ack")
class DoneAck:
    request_id: Id
    ok: Bool
    reason: Text


@message("cancel")
class Cancel:
    request_id: Id


@message("cancel_ack")
class CancelAck:
    request_id: Id


KV_MESSAGES = frozenset({"hello", "hello_ok", "kv_error", "kv", "done", "done_ack", "cancel", "cancel_ack"})


def encode(msg_type: str, **fields: Any) -> bytes:
    if msg_type not in KV_MESSAGES:
        raise ValueError(f"unknown KV message type {msg_type!r}")
    return codec.encode(msg_type, **fields)


def decode(raw: bytes | memoryview) -> dict[str, Any]:
    """Bytes -> validated map (type, version and every field checked), or ProtocolError."""
    return codec.decode(raw, KV_MESSAGES, MAX_HEADER_BYTES)


@dataclass(slots=True)
class KVHeader:
    """A `kv` message checked against the local layout (but not yet against the expected request)."""

    request_id: str
    layer: int
    dest_block_ids: list[int]
    checksum: int | None
    tag: int | None
    data_nbytes: int  # of one layer
    scale_nbytes: int
    layers: list[int]  # [layer], or the several layers one shm notification covers

    @property
    def nbytes(self) -> int:
        return (self.data_nbytes + self.scale_nbytes) * len(self.layers)


def kv_header(
    layout: CacheLayout, request_id: str, layer: int, dest_block_ids: list[int],
    checksum: int | None = None, tag: int | None = None, layers: list[int] | None = None,
) -> bytes:
    """The per-layer `kv` message (or, with `layers`, one for several layers' same blocks). Its fields
    come checked (BaseSender.send_layer: request id, layer, block ids; the rest from the layout), so it
    skips encode()'s walk over a few hundred ids."""
    n = len(dest_block_ids)
    return codec.pack_checked("kv", dict(
        request_id=request_id, layer=layer, dest_block_ids=dest_block_ids,
        dtype=layout.kv_cache_dtype, shape=[n, *layout.block_shape],
        scale_shape=[n, *layout.scale_block_shape] if layout.is_quantized else None,
        checksum=checksum, tag=tag, layers=layers,
    ))


def parse_kv(msg: dict[str, Any], layout: CacheLayout) -> KVHeader:
    """A decoded `kv` map -> KVHeader, or ProtocolError if it cannot belong to this layout."""
    ids = msg["dest_block_ids"]
    n = len(ids)
    if n == 0:
        raise ProtocolError("kv: no dest_block_ids")
    if len(set(ids)) != n:
        raise ProtocolError("kv: duplicate dest_block_ids")
    if not msg["layer"] < layout.num_layers:
        raise ProtocolError(f"kv: layer {msg['layer']} out of range (model has {layout.num_layers})")
    layers = msg.get("layers")
    if layers is None:
        layers = [msg["layer"]]
    elif not layers or layers[0] != msg["layer"] or len(set(layers)) != len(layers) or max(
            layers) >= layout.num_layers or msg.get("checksum") is not None:
        raise ProtocolError(f"kv: layers {str(layers)[:40]} are not distinct layers of the model starting at "
                            f"layer {msg['layer']} (and carry no checksum)")
    if msg["dtype"] != layout.kv_cache_dtype:
        raise ProtocolError(f"kv: dtype {msg['dtype']!r} but the cache is {layout.kv_cache_dtype!r}")
    if msg["shape"] != [n, *layout.block_shape]:
        raise ProtocolError(f"kv: shape {msg['shape'][:6]} but expected {[n, *layout.block_shape]}")
    want_scale = [n, *layout.scale_block_shape] if layout.is_quantized else None
    if msg["scale_shape"] != want_scale:
        raise ProtocolError(f"kv: scale_shape {str(msg['scale_shape'])[:40]} but expected {want_scale}")
    return KVHeader(
        request_id=msg["request_id"], layer=msg["layer"], dest_block_ids=ids, checksum=msg.get("checksum"),
        tag=msg.get("tag"), data_nbytes=n * layout.block_nbytes, scale_nbytes=n * layout.scale_block_nbytes,
        layers=layers,
    )


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as a flat byte view (no copy; works for fp8/bf16 too).

    Built with ctypes rather than `tensor.numpy()`: numpy is not a dependency of tandem, and this
    is as fast (one small object per call, no copy). The view keeps the tensor alive."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("as_bytes needs a contiguous CPU tensor")
    if t.nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())
    buf._owner = t  # type: ignore[attr-defined]  # the memory stays valid as long as the view lives
    return memoryview(buf).cast("B")


def payload_crc(*tensors: torch.Tensor | None) -> int:
    """crc32 over the bytes of the given tensors, in order (None skipped)."""
    crc = 0
    for t in tensors:
        if t is not None:
            crc = zlib.crc32(as_bytes(t.contiguous()), crc)
    return crc
