"""RemoteKV: a decode worker's bookkeeping for requests whose prompt KV comes from a prefill worker —
the connector's receiving half, the first tokens P sends, and when blocks are safe to reuse.

A request is *ready* when its last layer has arrived and P's `prefill_done` came in (two channels,
either order). It is *released* when the receiver reports TransferFailed — a timeout (P silent),
a sender-side cancel, or the confirmation of our own `cancel()`. Only then may its blocks be
recomputed or freed: with the shm connector P writes D's memory directly, and the receiver's
TransferFailed is the fence after which it no longer does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kvtransfer import KVReceiver, LayerReceived, TransferDone, TransferFailed


@dataclass(slots=True)
class Pending:
    peer: str
    kv_done_at: float | None = None
    first_token: int | None = None
    first_logprobs: list | None = None  # [[token_id, logprob], ...] from P, when the request asked
    cancelled: bool = False


@dataclass(slots=True)
class Released:
    request_id: str
    cancelled_by_us: bool
    reason: str


class RemoteKV:
    def __init__(self, receiver: KVReceiver, timeout_s: float, trace: Callable[..., None]) -> None:
        self.receiver = receiver
        self.timeout_s = timeout_s  # idle time without KV progress, and wait for P's first token
        self.trace = trace
        self.pending: dict[str, Pending] = {}
        self._released_now: list[Released] = []  # cancelled after their KV was complete
        self.bytes_received = 0

    @property
    def address(self) -> str:
        return self.receiver.address

    def expect(self, rid: str, peer: str, dest_block_ids: list[int]) -> None:
        self.receiver.expect(rid, dest_block_ids, timeout_s=self.timeout_s)
        self.pending[rid] = Pending(peer)

    def first_token(self, rid: str, token: int, logprobs: list | None = None) -> bool:
        p = self.pending.get(rid)
        if p is None or p.cancelled:
            return False
        p.first_token, p.first_logprobs = token, logprobs
        return True

    def poll(self) -> tuple[list[tuple[str, int, list | None]], list[Released]]:
        """Apply arrived KV. Returns (ready: (request id, first token, its logprobs), released requests)."""
        released, self._released_now = self._released_now, []
        for ev in self.receiver.poll(0):
            p = self.pending.get(ev.request_id)
            if p is None:
                continue
            if isinstance(ev, LayerReceived):
                if ev.layer == 0:  # the receiver's I/O thread stamped its arrival
                    self.trace(ev.request_id, "first_layer_received_ns", ev.t_monotonic_ns)
            elif isinstance(ev, TransferDone):
                p.kv_done_at = time.monotonic()
                self.bytes_received += ev.bytes
                self.trace(ev.request_id, "last_layer_received_ns")
            elif isinstance(ev, TransferFailed):
                del self.pending[ev.request_id]
                released.append(Released(ev.request_id, p.cancelled, ev.reason))
        ready, now = [], time.monotonic()
        for rid, p in list(self.pending.items()):
            if p.kv_done_at is None or p.cancelled:
                continue
            if p.first_token is not None:
                ready.append((rid, p.first_token, p.first_logprobs))
                del self.pending[rid]
            elif now - p.kv_done_at > self.timeout_s:  # KV complete (writes over) but P never said done
                del self.pending[rid]
                released.append(Released(rid, False, "prefill peer sent the KV but no first token"))
        return ready, released

    def cancel(self, rid: str) -> str | None:
        """Stop accepting KV for rid; it is released (blocks safe) on a later poll. Returns its peer,
        or None if rid has no transfer in flight."""
        p = self.pending.get(rid)
        if p is None or p.cancelled:
            return None
        p.cancelled = True
        if p.kv_done_at is not None:  # nothing more can be written: release at once
            del self.pending[rid]
            self._released_now.append(Released(rid, True, "cancelled"))
        else:
            self.receiver.cancel(rid)
        return p.peer

    def stats(self) -> dict:
        return {"kv_bytes_received": self.bytes_received, "waiting_for_kv_transfer": len(self.pending)}

    def close(self) -> None:
        self.receiver.close()
