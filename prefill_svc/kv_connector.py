"""PrefillKVConnector: a prefill worker's KV connector — pushes each request's blocks to its decode
worker layer by layer as the forward pass stores them, and completes the transfer with the first token.

Worker half only (a prefill engine computes every prompt itself):
- `expect_push(rid, dest, send_from, dest_block_ids)`: where a request's KV goes (set by the
  service before it queues the request).
- `save_layer`: right after `layer` stored this step's K/V, the request's blocks at or beyond
  `send_from` whose tokens are now all computed go to D's `dest_block_ids` for that layer — the
  transfer overlaps the remaining layers' compute (chunked prefill sends a layer once per chunk).
- `request_finished`: the first token is sampled (its logprobs recorded): `done` follows the last
  layer on the same link, carrying the first token, so D has the KV and the token at once. D's ack is
  not awaited. An aborted request is cancelled instead.

Scheduler half: the step that computes a prompt's last tokens also samples its first token and
finishes it, so nothing can preempt it between that step's sends and its end. Those sends lend the
sender the blocks (`borrow=True`: zmq sends them without copying them out), and `hold_blocks` keeps
them allocated until D acknowledges the transfer (or it fails); `poll` releases them. Earlier chunks'
sends are copied: a request can be preempted between chunks, and its blocks reused. A D that never
answers (dead, not coming back) must not keep them: after `hold_timeout_s` the connector gives the
receiver up (`on_stuck(dest)`, by default the sender's `disconnect`: ZMQ drops what it still queues for
it and its unfinished transfers fail), which frees them.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import structlog

from kvtransfer import KVSender
from tandem.engine.kv_connector import KVConnector, KVUpdates
from tandem.engine.request import Request

if TYPE_CHECKING:
    import torch

    from tandem.engine.scheduler import SchedulerOutput

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Outbound:
    """One request's transfer: where its blocks go and how far each layer has been sent."""

    dest: str
    send_from_block: int
    dest_block_ids: list[int]
    sent: list[int]  # per layer: blocks [send_from_block, sent[layer]) already pushed
    lent: bool = False  # some were sent with borrow=True: hold the blocks until D acknowledges


class PrefillKVConnector(KVConnector):
    HOLD_TIMEOUT_S = 60.0  # a live D acknowledges within a step; one silent this long is given up

    def __init__(self, sender: KVSender, block_size: int, num_layers: int,
                 trace: Callable[..., None] | None = None, on_stuck: Callable[[str], None] | None = None) -> None:
        self.sender = sender
        self.block_size = block_size
        self.num_layers = num_layers  # cache layers: the layout's, hidden-state layers included
        self.trace = trace or (lambda *a: None)
        self.outbound: dict[str, Outbound] = {}
        self.completed = 0
        self.held: dict[str, tuple[str, float]] = {}  # finished, blocks lent: rid -> (D, give-up time)
        self.on_stuck = on_stuck or sender.disconnect
        self.hold_timeout_s = self.HOLD_TIMEOUT_S
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()  # filled by finish callbacks (I/O thread)

    def expect_push(self, rid: str, dest: str, send_from: int, dest_block_ids: list[int]) -> None:
        first = send_from // self.block_size
        self.outbound[rid] = Outbound(dest, first, list(dest_block_ids), [first] * self.num_layers)

    def cancel(self, rid: str) -> bool:
        """D aborted: send nothing more for it. False if it was not (or no longer) being pushed."""
        if self.outbound.pop(rid, None) is None:
            return False
        self.sender.cancel(rid)
        return True

    def save_layer(self, layer: int, schedule: SchedulerOutput, kv_caches: list[torch.Tensor],
                   kv_scales: list[torch.Tensor] | None) -> None:
        bs, last_layer = self.block_size, layer == self.num_layers - 1
        for s in schedule.scheduled:
            req = s.request
            job = self.outbound.get(req.request_id)
            if job is None:
                continue
            done_tokens = req.num_computed_tokens + s.num_new_tokens
            ready = -(-req.num_tokens // bs) if done_tokens >= req.num_tokens else done_tokens // bs
            first = job.sent[layer]
            if ready <= first:
                continue
            src = req.block_ids[first:ready]
            dest = job.dest_block_ids[first - job.send_from_block: ready - job.send_from_block]
            scales = kv_scales[layer] if kv_scales is not None else None
            last_chunk = done_tokens >= req.num_tokens
            try:
                self.sender.send_layer(job.dest, req.request_id, layer, kv_caches[layer], scales, src, dest,
                                       borrow=last_chunk)
            except ValueError as exc:  # D was given up (or restarted) while this request queued here
                log.warning("KV push dropped: its decode worker is gone", request_id=req.request_id, dest=job.dest,
                            error=str(exc))
                del self.outbound[req.request_id]  # D recomputes it if it still waits: never wrong
                continue
            job.lent |= last_chunk
            job.sent[layer] = ready
            if layer == 0:
                self.trace(req.request_id, "first_layer_sent_ns")
            if last_layer and last_chunk:
                self.trace(req.request_id, "last_layer_computed_ns")

    def hold_blocks(self, req: Request) -> bool:
        """Asked as the request finishes, before `request_finished`. A cancelled or aborted one is
        freed at once: whatever the sender still reads from its blocks, D drops (it is not expected)."""
        job = self.outbound.get(req.request_id)
        if job is None or not job.lent or req.finish_reason == "abort" or not req.output_token_ids:
            return False
        self.held[req.request_id] = (job.dest, time.monotonic() + self.hold_timeout_s)
        return True

    def poll(self) -> KVUpdates:
        released: list[str] = []
        now = time.monotonic()
        stuck = {dest for dest, give_up in self.held.values() if now > give_up}
        for dest in stuck:
            log.warning("decode worker never acknowledged lent KV blocks: giving it up", dest=dest,
                        held=sum(d == dest for d, _ in self.held.values()), timeout_s=self.hold_timeout_s)
            self.on_stuck(dest)  # nothing is sent to it any more: every block lent to it is free to go
            released += [rid for rid, (d, _) in self.held.items() if d == dest]
        for rid in released:
            del self.held[rid]
        while not self._released.empty():
            rid = self._released.get_nowait()
            if self.held.pop(rid, None) is not None:
                released.append(rid)
        return KVUpdates(released=released)

    @property
    def has_pending(self) -> bool:
        return bool(self.held)

    def request_finished(self, req: Request) -> None:
        rid = req.request_id
        job = self.outbound.pop(rid, None)
        if job is None:
            return
        if req.finish_reason == "abort" or not req.output_token_ids:
            self.sender.cancel(rid)
            return
        result: dict[str, Any] = {"first_token": req.output_token_ids[0]}
        if req.logprobs:  # the first token's logprobs, as [[token_id, logprob], ...]
            result["logprobs"] = [[t, lp] for t, lp in req.logprobs[0].items()]
        fut = self.sender.finish_async(rid, job.dest, result)
        if rid in self.held:  # D's answer (or the transfer's failure) means nothing reads the blocks now
            fut.add_done_callback(lambda _: self._released.put(rid))
        self.completed += 1
        self.trace(req.request_id, "done_ns")
        log.info("prefill finished", request_id=req.request_id, dest=job.dest, blocks=len(job.dest_block_ids))
