"""Control messages (router <-> workers, decode <-> prefill): one msgpack map per ZMQ frame, with a
`type` and the protocol version `v`. Never pickle.

Every received frame goes through `decode()`, which checks the map against the schema below and
raises ProtocolError with a message naming the bad field; a worker answers that with an `error`
message and keeps serving. `encode()` is the only way messages are built.

| type            | from -> to        | fields                                                                 |
| --------------- | ----------------- | ---------------------------------------------------------------------- |
| add_request     | router -> D       | id, token_ids, sampling, prefill_peer (P control address or None)      |
| abort           | router -> D, D -> P | id                                                                   |
| output          | D -> router       | id, token_ids (new), text (delta), finished, finish_reason, num_cached_tokens, num_prompt_tokens |
| error           | any -> sender     | id (or None), message                                                  |

Replies go back on the socket identity the request came from (P answers D's own DEALER socket).
| prefill         | D -> P            | id, token_ids, sampling, send_from, dest (KV receiver address), dest_block_ids |
| prefill_done    | P -> D            | id, first_token                                                        |
| prefill_failed  | P -> D            | id, message                                                            |
| stats           | any -> worker     | (none)                                                                 |
| stats_reply     | worker -> sender  | stats (map)                                                            |
| trace           | any -> worker     | id                                                                     |
| trace_reply     | worker -> sender  | id, events (map of name -> monotonic ns)                               |
| register        | worker -> router  | worker_id, role ("decode" or "prefill"), control_address, model, interval_ms (heartbeat period) |
| heartbeat       | worker -> router  | worker_id, stats (the worker's stats map); an unknown worker_id is answered with `error` |
"""

from __future__ import annotations

from typing import Any

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 2**20


class ProtocolError(ValueError):
    """A frame that is not a valid control message (the text says what is wrong)."""


_STR, _INT, _BOOL, _MAP, _INTS, _OPT_STR = "str", "int", "bool", "map", "ints", "str|None"
SCHEMAS: dict[str, dict[str, str]] = {
    "add_request": {"id": _STR, "token_ids": _INTS, "sampling": _MAP, "prefill_peer": _OPT_STR},
    "abort": {"id": _STR},
    "output": {"id": _STR, "token_ids": _INTS, "text": _STR, "finished": _BOOL, "finish_reason": _OPT_STR,
               "num_cached_tokens": _INT, "num_prompt_tokens": _INT},
    "error": {"id": _OPT_STR, "message": _STR},
    "prefill": {"id": _STR, "token_ids": _INTS, "sampling": _MAP, "send_from": _INT, "dest": _STR,
                "dest_block_ids": _INTS},
    "prefill_done": {"id": _STR, "first_token": _INT},
    "prefill_failed": {"id": _STR, "message": _STR},
    "stats": {},
    "stats_reply": {"stats": _MAP},
    "trace": {"id": _STR},
    "trace_reply": {"id": _STR, "events": _MAP},
    "register": {"worker_id": _STR, "role": _STR, "control_address": _STR, "model": _STR, "interval_ms": _INT},
    "heartbeat": {"worker_id": _STR, "stats": _MAP},
}
# Optional fields a message may carry beyond its schema (passed through unchecked but typed here).
OPTIONAL: dict[str, dict[str, str]] = {
    "add_request": {"text": _STR},  # the original prompt text, for logs only
    "output": {"logprobs": "any", "stop_reason": "any"},
    "prefill_done": {"logprobs": "any"},  # the first token's [[token_id, logprob], ...] when asked for
}


def _check(kind: str, value: Any) -> bool:
    if kind == _STR:
        return isinstance(value, str)
    if kind == _OPT_STR:
        return value is None or isinstance(value, str)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _MAP:
        return isinstance(value, dict)
    if kind == _INTS:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return True


def encode(msg_type: str, **fields: Any) -> bytes:
    if msg_type not in SCHEMAS:
        raise ValueError(f"unknown message type {msg_type!r}")
    return msgpack.packb({"type": msg_type, "v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def decode(frame: bytes) -> dict[str, Any]:
    """Parse and validate one control frame."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a control message must be a msgpack map")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not supported (this worker speaks {PROTOCOL_VERSION})")
    msg_type = msg.get("type")
    schema = SCHEMAS.get(msg_type) if isinstance(msg_type, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {msg_type!r}; known: {sorted(SCHEMAS)}")
    for name, kind in schema.items():
        if name not in msg:
            raise ProtocolError(f"{msg_type}: missing field {name!r}")
        if not _check(kind, msg[name]):
            raise ProtocolError(f"{msg_type}: field {name!r} must be {kind}, got {type(msg[name]).__name__}")
    for name, kind in OPTIONAL.get(msg_type, {}).items():
        if name in msg and not _check(kind, msg[name]):
            raise ProtocolError(f"{msg_type}: field {name!r} must be {kind}")
    return msg
