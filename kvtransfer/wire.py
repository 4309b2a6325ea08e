"""Wire format of the KV connectors: msgpack control/header maps, their validation, payload checksums.

Every message is one msgpack map with `type` and `version`; KV data follows the header as raw
frames (zmq), already sits in D's memory (shm), or follows over torch.distributed (torch_dist).
Nothing is ever pickled. `decode` + `parse_kv` reject anything malformed with `ProtocolError`,
whose text goes to the log (and back to the peer for a bad handshake).

    hello       sender -> receiver   connector, sender_id, layout, data_id (identity of its data socket)
    hello_ok    receiver -> sender   layout, extra (connector specific: shm segment, store address)
    error       receiver -> sender   reason
    kv          sender -> receiver   request_id, layer, dest_block_ids, dtype, shape, scale_shape, checksum, tag
    done        sender -> receiver   request_id, messages, bytes (what the sender sent for it)
    done_ack    receiver -> sender   request_id, ok, reason
    cancel      either way           request_id
    cancel_ack  sender -> receiver   request_id (the sender will write nothing more for it)
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import torch

from kvtransfer.base import CacheLayout

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # a header lists block ids; 1 MiB is ~200k blocks, far beyond any request
MAX_ID_LEN = 512
MAX_INT = (1 << 63) - 1
MAX_TAG = (1 << 31) - 1  # torch.distributed tags are C ints


class ProtocolError(ValueError):
    """A message that does not follow this file; the text says what is wrong with it."""


def _is_int(v: Any, lo: int = 0, hi: int = MAX_INT) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _int(v: Any) -> bool:
    return _is_int(v)


def _str(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_ID_LEN


def _int_list(v: Any) -> bool:
    # type(x) is int rejects bools; min/max bound the values without a call per element
    return isinstance(v, list) and all(type(x) is int for x in v) and (not v or (min(v) >= 0 and max(v) <= MAX_INT))


def _opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_SCHEMAS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "hello": {"connector": _str, "sender_id": _str, "layout": lambda v: isinstance(v, dict),
              "data_id": _opt(lambda v: isinstance(v, bytes) and 0 < len(v) <= 255)},
    "hello_ok": {"layout": lambda v: isinstance(v, dict), "extra": lambda v: isinstance(v, dict)},
    "error": {"reason": lambda v: isinstance(v, str)},
    "kv": {
        "request_id": _str,
        "layer": _int,
        "dest_block_ids": _int_list,
        "dtype": _str,
        "shape": _int_list,
        "scale_shape": _opt(_int_list),
        "checksum": _opt(lambda v: _is_int(v, 0, 0xFFFFFFFF)),
        "tag": _opt(lambda v: _is_int(v, 0, MAX_TAG)),
    },
    "done": {"request_id": _str, "messages": _int, "bytes": _int},
    "done_ack": {"request_id": _str, "ok": lambda v: isinstance(v, bool), "reason": lambda v: isinstance(v, str)},
    "cancel": {"request_id": _str},
    "cancel_ack": {"request_id": _str},
}


def encode(msg_type: str, **fields: Any) -> bytes:
    if msg_type not in _SCHEMAS:
        raise ValueError(f"unknown message type {msg_type!r}")
    return msgpack.packb({"type": msg_type, "version": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def decode(raw: bytes | memoryview) -> dict[str, Any]:
    """Bytes -> validated map (type, version and every field checked), or ProtocolError."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises a zoo of types on garbage; all mean "not a header"
        raise ProtocolError(f"not a msgpack header: {type(exc).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"header must be a map, got {type(msg).__name__}")
    version = msg.get("version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r}; this side speaks {PROTOCOL_VERSION}")
    schema = _SCHEMAS.get(msg.get("type"))  # type: ignore[arg-type]
    if schema is None:
        raise ProtocolError(f"unknown message type {str(msg.get('type'))[:40]!r}")
    fields = msg.keys() - {"type", "version"}
    if fields != schema.keys():
        raise ProtocolError(
            f"{msg['type']}: fields missing {sorted(schema.keys() - fields)} / unknown {sorted(map(str, fields - schema.keys()))[:5]}"
        )
    for name, check in schema.items():
        if not check(msg[name]):
            raise ProtocolError(f"{msg['type']}: bad value for {name!r}: {str(msg[name])[:60]}")
    return msg


@dataclass(slots=True)
class KVHeader:
    """A `kv` message checked against the local layout (but not yet against the expected request)."""

    request_id: str
    layer: int
    dest_block_ids: list[int]
    checksum: int | None
    tag: int | None
    data_nbytes: int
    scale_nbytes: int

    @property
    def nbytes(self) -> int:
        return self.data_nbytes + self.scale_nbytes


def kv_header(
    layout: CacheLayout, request_id: str, layer: int, dest_block_ids: list[int],
    checksum: int | None = None, tag: int | None = None,
) -> bytes:
    n = len(dest_block_ids)
    return encode(
        "kv", request_id=request_id, layer=layer, dest_block_ids=dest_block_ids,
        dtype=layout.kv_cache_dtype, shape=[n, *layout.block_shape],
        scale_shape=[n, *layout.scale_block_shape] if layout.is_quantized else None,
        checksum=checksum, tag=tag,
    )


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
    if msg["dtype"] != layout.kv_cache_dtype:
        raise ProtocolError(f"kv: dtype {msg['dtype']!r} but the cache is {layout.kv_cache_dtype!r}")
    if msg["shape"] != [n, *layout.block_shape]:
        raise ProtocolError(f"kv: shape {msg['shape'][:6]} but expected {[n, *layout.block_shape]}")
    want_scale = [n, *layout.scale_block_shape] if layout.is_quantized else None
    if msg["scale_shape"] != want_scale:
        raise ProtocolError(f"kv: scale_shape {str(msg['scale_shape'])[:40]} but expected {want_scale}")
    return KVHeader(
        request_id=msg["request_id"], layer=msg["layer"], dest_block_ids=ids, checksum=msg["checksum"],
        tag=msg["tag"], data_nbytes=n * layout.block_nbytes, scale_nbytes=n * layout.scale_block_nbytes,
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
