"""The one codec for every message tandem puts on a wire: control (router <-> workers, D <-> P,
tandem/protocol/messages.py) and KV transfer headers (kvtransfer/wire.py).

A message is one msgpack map: `type`, the protocol version `v`, and its fields. Its type is a
dataclass registered with `@message("name")`; field annotations are the small vocabulary below
(`Id`, `Count`, `Ints`, ... and `X | None`), and a field with a default may be left out. Nothing is
ever pickled.

- `encode(type, **fields)` checks the fields against the class (a bug on our side fails loudly
  here, not on the peer) and packs them.
- `decode(frame, kinds)` unpacks and checks type, version, every field (missing, unknown, wrong
  type or out of range) and raises `ProtocolError` naming what is wrong. A receiver logs it,
  answers with an error where it can, and keeps serving.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection

import msgpack

PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 64 * 2**20
MAX_INT = (1 << 63) - 1
MAX_ID_LEN = 512

# The field vocabulary: annotation name -> check. Plain aliases, so type checkers read them as well.
Id = str  # non-empty, at most MAX_ID_LEN characters (request / worker ids, addresses)
Text = str  # any string
Int = int  # any integer
Count = int  # 0 <= n <= MAX_INT
Bool = bool
Map = dict  # a msgpack map (string keys)
Ints = list  # list of Counts
Blob = bytes  # raw bytes, at most 255 (socket identities)
Any_ = object  # anything msgpack carries (logprob lists, stop reasons)


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_INT


_INT_ONLY = {int}


def only_ints(values: list | tuple) -> bool:
    """Every element's type is exactly int (bools are not), in C speed: a KV header carries a few
    hundred block ids per layer and is checked on both sides."""
    return set(map(type, values)) <= _INT_ONLY


_CHECKS: dict[str, Callable[[Any], bool]] = {
    "Id": lambda v: isinstance(v, str) and 0 < len(v) <= MAX_ID_LEN,
    "Text": lambda v: isinstance(v, str),
    "Int": lambda v: type(v) is int,
    "Count": _is_count,
    "Bool": lambda v: isinstance(v, bool),
    "Map": lambda v: isinstance(v, dict),
    # type(x) is int rejects bools; min/max bound the values without a call per element
    "Ints": lambda v: isinstance(v, list) and only_ints(v) and (
        not v or (min(v) >= 0 and max(v) <= MAX_INT)),
    "Blob": lambda v: isinstance(v, bytes) and 0 < len(v) <= 255,
    "Any_": lambda v: True,
    "None": lambda v: v is None,
}


class ProtocolError(ValueError):
    """A frame that is not a valid message (the text says what is wrong with it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Spec:
    required: dict[str, list[Callable[[Any], bool]]]
    optional: dict[str, list[Callable[[Any], bool]]]
    ranges: dict[str, int]  # field -> inclusive maximum (metadata "max")


MESSAGES: dict[str, type] = {}
_SPECS: dict[str, _Spec] = {}


def message(name: str) -> Callable[[type], type]:
    """Class decorator: a dataclass whose fields are message `name`'s, registered with the codec."""
    def register(cls: type) -> type:
        cls = dataclasses.dataclass(slots=True)(cls)
        if name in MESSAGES:
            raise ValueError(f"message type {name!r} is registered twice")
        req: dict[str, list[Callable[[Any], bool]]] = {}
        opt: dict[str, list[Callable[[Any], bool]]] = {}
        ranges: dict[str, int] = {}
        for f in dataclasses.fields(cls):
            checks = [_CHECKS[part.strip()] for part in str(f.type).split("|")]
            optional = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            (opt if optional else req)[f.name] = checks
            if "max" in f.metadata:
                ranges[f.name] = f.metadata["max"]
        MESSAGES[name], _SPECS[name] = cls, _Spec(req, opt, ranges)
        return cls
    return register


def _problem(msg_type: str, fields: dict[str, Any]) -> str | None:
    spec = _SPECS[msg_type]
    missing = spec.required.keys() - fields.keys()
    unknown = fields.keys() - spec.required.keys() - spec.optional.keys()
    if missing or unknown:
        return f"{msg_type}: fields missing {sorted(missing)} / unknown {sorted(map(str, unknown))[:5]}"
    for name, value in fields.items():
        checks = spec.required.get(name) or spec.optional[name]
        if not any(check(value) for check in checks):
            return f"{msg_type}: bad value for {name!r}: {str(value)[:60]}"
        if name in spec.ranges and value is not None and value > spec.ranges[name]:
            return f"{msg_type}: {name!r} = {value} exceeds {spec.ranges[name]}"
    return None


def encode(msg_type: str, **fields: Any) -> bytes:
    if msg_type not in _SPECS:
        raise ValueError(f"unknown message type {msg_type!r}")
    problem = _problem(msg_type, fields)
    if problem is not None:
        raise ValueError(f"cannot send {problem}")
    return pack_checked(msg_type, fields)


def pack_checked(msg_type: str, fields: dict[str, Any]) -> bytes:
    """encode() without the field checks, for a hot path whose caller has checked every field
    itself (the per-layer KV header: ids and layer checked by send_layer, the rest from the layout).
    The receiver's decode() checks everything regardless."""
    return msgpack.packb({"type": msg_type, "v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def decode(frame: bytes | memoryview, kinds: Collection[str] | None = None,
           max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """One frame -> its validated map; `kinds` limits the types this socket accepts."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {max_bytes}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_str_len=max_bytes)
    except Exception as exc:  # msgpack raises a zoo of types on garbage; all mean "not a message"
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a msgpack map, got {type(msg).__name__}")
    version = msg.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r}; this side speaks {PROTOCOL_VERSION}")
    msg_type = msg.get("type")
    if not isinstance(msg_type, str) or msg_type not in _SPECS or (kinds is not None and msg_type not in kinds):
        known = sorted(kinds if kinds is not None else _SPECS)
        raise ProtocolError(f"unknown message type {str(msg_type)[:40]!r}; this socket takes {known}")
    problem = _problem(msg_type, {k: v for k, v in msg.items() if k != "type"})
    if problem is not None:
        raise ProtocolError(problem)
    return msg
