"""DecodeKVConnector: a decode worker's KV connector — whose prompts come from a prefill peer, asking
that peer for them, and telling the engine when they have arrived or failed.

Scheduler half:
- `num_external_tokens`: the uncached rest of the prompt comes from the request's prefill peer
  (`req.kv_peer`, chosen by the router), unless it has none or fewer than
  `local_prefill_threshold` tokens are uncached: then this worker computes them (0).
- `on_allocated`: the receiver expects the blocks past the prefix hit, and P gets
  `prefill(id, token_ids, sampling, send_from, dest, dest_block_ids)`.
- `hold_blocks`: an aborted request whose KV may still be landing keeps its blocks until the
  receiver confirms nothing more is written (with shm, P writes D's memory directly; the receiver's
  TransferFailed is the fence).

Worker half, `poll()`: the receiver's events become `KVUpdates` — TransferDone carries the first
token P sampled (and its logprobs) in its result, so the request joins the batch at once; a
failure (P refused, died or went quiet for `timeout_s`) means recompute locally; a confirmed cancel
releases held blocks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from kvtransfer import KVReceiver, LayerReceived, TransferDone, TransferFailed
from tandem.engine.kv_connector import Arrived, KVConnector, KVUpdates
from tandem.engine.request import Request

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Transfer:
    peer: str
    after_release: str = ""  # "" in flight | "abort": free the blocks | "local": recompute here


@dataclass(slots=True)
class DecodeKVStats:
    remote_prefills: int = 0
    local_prefills: int = 0
    fallbacks: int = 0
    last_fallback_reason: str = ""
    transferred_blocks: int = 0
    reused_blocks: int = 0
    bytes_received: int = 0


class DecodeKVConnector(KVConnector):
    def __init__(self, receiver: KVReceiver, send_to_peer: Callable[..., None], block_size: int,
                 local_prefill_threshold: int = 0, timeout_s: float = 30.0,
                 trace: Callable[..., None] | None = None,
                 on_remote_start: Callable[[Request], None] | None = None) -> None:
        """`send_to_peer(peer, msg_type, **fields)` raises ConnectionError when P cannot be reached;
        `trace(request_id, event, t_ns=None)` records lifecycle stamps (`*_ns` events)."""
        self.receiver = receiver
        self.send_to_peer = send_to_peer
        self.block_size = block_size
        self.local_prefill_threshold = local_prefill_threshold
        self.timeout_s = timeout_s
        self.trace = trace or (lambda *a: None)
        self.on_remote_start = on_remote_start or (lambda req: None)  # its queue time ends here
        self.transfers: dict[str, _Transfer] = {}
        self.stats = DecodeKVStats()
        self.instance = uuid.uuid4().hex  # P handshakes again with a receiver restarted at the same address

    @property
    def address(self) -> str:
        return self.receiver.address

    # ---- scheduler half ------------------------------------------------------------------------
    def num_external_tokens(self, req: Request, num_computed: int) -> int:
        uncached = req.num_tokens - num_computed
        self.stats.reused_blocks += num_computed // self.block_size
        if req.kv_peer is None or uncached < self.local_prefill_threshold:
            self.stats.local_prefills += 1
            return 0
        return uncached

    def on_allocated(self, req: Request, num_computed: int) -> None:
        rid, peer = req.request_id, req.kv_peer
        assert peer is not None  # num_external_tokens said it comes from a peer
        # Under a sliding window the prompt's blocks before the first decode step's window were not
        # allocated (NULL_BLOCK): P sends from the first block held, as if the rest were a prefix hit.
        first = num_computed // self.block_size
        while first < len(req.block_ids) and req.block_ids[first] < 0:
            first += 1
        num_computed = first * self.block_size
        dest = req.block_ids[first:]
        self.receiver.expect(rid, dest, timeout_s=self.timeout_s)
        self.transfers[rid] = _Transfer(peer)
        self.stats.remote_prefills += 1
        self.stats.transferred_blocks += len(dest)
        self.trace(rid, "prefill_sent_ns")
        self.on_remote_start(req)
        try:
            # prompt logprobs are this worker's to compute (LLMEngine.make_request), not P's
            sampling = {**req.params.to_dict(), "prompt_logprobs": None}
            self.send_to_peer(peer, "prefill", id=rid, token_ids=req.prompt_token_ids, sampling=sampling,
                              send_from=num_computed, dest=self.receiver.address, dest_block_ids=dest,
                              dest_instance=self.instance)
        except ConnectionError as exc:
            self.peer_failed(rid, str(exc))

    def hold_blocks(self, req: Request) -> bool:
        t = self.transfers.get(req.request_id)
        if t is None:
            return False
        if not t.after_release:
            self._cancel(req.request_id, t)
        t.after_release = "abort"
        return True

    # ---- from the prefill peer (control messages) ---------------------------------------------
    def peer_failed(self, rid: str, reason: str) -> None:
        """P refused or failed the prefill: stop its KV, recompute once the blocks are ours again."""
        t = self.transfers.get(rid)
        if t is None or t.after_release:
            return
        log.warning("prefill fallback: recomputing locally", request_id=rid, reason=reason)
        self.stats.last_fallback_reason = reason
        t.after_release = "local"
        self._cancel(rid, t)

    def peer_gone(self, peer: str) -> None:
        """P's connection dropped (killed, stopped, unreachable): its transfers will not finish."""
        for rid, t in list(self.transfers.items()):
            if t.peer == peer:
                self.peer_failed(rid, f"the prefill worker at {peer} disconnected")

    def _cancel(self, rid: str, t: _Transfer) -> None:
        self.receiver.cancel(rid)  # a later poll reports TransferFailed: the fence
        try:
            self.send_to_peer(t.peer, "abort", id=rid)
        except ConnectionError:
            pass  # a dead peer needs no abort

    # ---- worker half ---------------------------------------------------------------------------
    def poll(self) -> KVUpdates:
        updates = KVUpdates()
        for ev in self.receiver.poll(0):
            t = self.transfers.get(ev.request_id)
            if t is None:
                continue
            if isinstance(ev, LayerReceived):
                if ev.layer == 0:  # the receiver's I/O thread stamped its arrival
                    self.trace(ev.request_id, "first_layer_received_ns", ev.t_monotonic_ns)
                continue
            if isinstance(ev, TransferDone):
                self.trace(ev.request_id, "last_layer_received_ns")
            del self.transfers[ev.request_id]
            arrived = self._arrived(ev) if isinstance(ev, TransferDone) and not t.after_release else None
            if arrived is not None:
                self.stats.bytes_received += ev.bytes
                self.trace(ev.request_id, "kv_ready_ns")
                updates.arrived.append(arrived)
            elif t.after_release == "abort":
                updates.released.append(ev.request_id)
            else:  # failed, timed out, or cancelled for a fallback: the blocks are ours to recompute
                reason = ev.reason if isinstance(ev, TransferFailed) else "the KV came without a first token"
                if not t.after_release:
                    log.warning("prefill fallback: recomputing locally", request_id=ev.request_id, reason=reason)
                    self.stats.last_fallback_reason = reason
                self.stats.fallbacks += 1
                updates.failed.append((ev.request_id, reason))
        return updates

    @staticmethod
    def _arrived(ev: TransferDone) -> Arrived | None:
        """The first token P sampled rides in the transfer's completion message."""
        token, logprobs = ev.result.get("first_token"), ev.result.get("logprobs")
        if type(token) is not int or not (logprobs is None or isinstance(logprobs, list)):
            return None
        return Arrived(ev.request_id, token, logprobs)

    @property
    def has_pending(self) -> bool:
        return bool(self.transfers)

    def stats_dict(self) -> dict[str, Any]:
        s = self.stats
        return {"remote_prefills": s.remote_prefills, "local_prefills": s.local_prefills, "fallbacks": s.fallbacks,
                "last_fallback_reason": s.last_fallback_reason, "transferred_blocks": s.transferred_blocks,
                "reused_blocks": s.reused_blocks, "kv_bytes_received": s.bytes_received,
                "waiting_for_kv_transfer": len(self.transfers)}

    def close(self) -> None:
        self.receiver.close()
