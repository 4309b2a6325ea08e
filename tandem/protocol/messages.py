"""Control messages (router <-> workers, decode <-> prefill), one typed class each, carried by the one
codec (tandem/protocol/codec.py): one msgpack map per ZMQ frame with `type` and the version `v`.

Every received frame goes through `decode()`; a bad one raises ProtocolError naming the bad field, and
the worker answers with an `error` message and keeps serving. Replies go back on the socket identity
the request came from (P answers D's own DEALER socket).

| type            | from -> to          |
| --------------- | ------------------- |
| add_request     | router -> D         |
| abort           | router -> D, D -> P |
| output          | D -> router         |
| error           | any -> sender       |
| prefill         | D -> P              |
| prefill_failed  | P -> D              |
| stats / stats_reply | any -> worker -> sender |
| trace / trace_reply | any -> worker -> sender |
| register / heartbeat / deregister | worker -> router (an unknown worker_id is answered with `error`) |

A prefill worker's first token travels with the KV it computed (the transfer's `done`,
kvtransfer/wire.py), not as a control message.
"""

from __future__ import annotations

from typing import Any

from tandem.protocol import codec
from tandem.protocol.codec import PROTOCOL_VERSION, Any_, Bool, Count, Id, Ints, Map, ProtocolError, Text, message

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "CONTROL", "encode", "decode"]


@message("add_request")
class AddRequest:
    id: Id
    token_ids: Ints
    sampling: Map
    prefill_peer: Id | None  # the prefill worker's control address; None: D computes the prompt
    text: Text | None = None  # the original prompt text, for logs only
    beam: Map | None = None  # BeamSearchParams as a map: a beam search of the prompt (one `output`, with `beams`)


@message("abort")
class Abort:
    id: Id


@message("output")
class Output:
    id: Id
    token_ids: Ints  # new tokens
    text: Text  # their text delta
    finished: Bool
    finish_reason: Text | None
    num_cached_tokens: Count
    num_prompt_tokens: Count
    logprobs: Any_ = None  # per new token: [[token_id, logprob], ...]
    stop_reason: Any_ = None
    queue_time_s: Any_ = None
    prompt_logprobs: Any_ = None  # first output only, when asked: per prompt token [[token_id, logprob], ...] | None
    beams: Any_ = None  # a beam search's answer: [{token_ids, text, cumulative_logprob, finish_reason, stop_reason}]


@message("error")
class Error:
    id: Id | None
    message: Text
    retry: Bool = False  # the request was not admitted here and nothing of it ran: send it to another worker


@message("prefill")
class Prefill:
    id: Id
    token_ids: Ints
    sampling: Map
    send_from: Count  # tokens D already holds (a block multiple)
    dest: Id  # D's KV receiver address
    dest_block_ids: Ints
    dest_instance: Id | None = None  # D's receiver instance: a new one at the same address means "handshake again"


@message("prefill_failed")
class PrefillFailed:
    id: Id
    message: Text


@message("stats")
class Stats:
    pass


@message("stats_reply")
class StatsReply:
    stats: Map


@message("trace")
class Trace:
    id: Id


@message("trace_reply")
class TraceReply:
    id: Id
    events: Map  # name -> monotonic ns


@message("register")
class Register:
    worker_id: Id
    role: Text  # "decode" | "prefill"
    control_address: Id
    model: Text
    interval_ms: Count  # heartbeat period
    kv_layout: Map | None = None  # a worker with a KV connector: its CacheLayout (P and D must agree)
    kv_address: Id | None = None  # a decode worker's KV receiver: where prefill workers push its prompts


@message("heartbeat")
class Heartbeat:
    worker_id: Id
    stats: Map  # the worker's stats, plus loop_age_s and loops (progress) and draining


@message("deregister")
class Deregister:
    worker_id: Id


@message("set_role")
class SetRole:
    role: Text  # router -> worker: drain the current role, then register and serve in this one


@message("drain")
class Drain:
    pass  # router -> worker: as SIGTERM: finish what is in flight, deregister, exit 0


@message("decode_lost")
class DecodeLost:
    dest: Id  # router -> prefill workers: the KV receiver of a decode worker declared dead or hung


CONTROL = frozenset({"add_request", "abort", "output", "error", "prefill", "prefill_failed", "stats", "stats_reply",
                     "trace", "trace_reply", "register", "heartbeat", "deregister", "set_role", "drain",
                     "decode_lost"})


def encode(msg_type: str, **fields: Any) -> bytes:
    if msg_type not in CONTROL:
        raise ValueError(f"unknown control message type {msg_type!r}")
    return codec.encode(msg_type, **fields)


def decode(frame: bytes) -> dict[str, Any]:
    """Parse and validate one control frame."""
    return codec.decode(frame, CONTROL)
