"""DecodeWorker: one request's path through a decode worker (D).

1. `add_request` arrives on the control socket; sampling and prompt are validated (a bad one is
   answered with `error`, nothing else changes).
2. D looks up its own prefix cache and allocates blocks for the rest of the prompt
   (`Scheduler.add_remote`). With no prefill peer, or fewer than `local_prefill_threshold` uncached
   tokens, D computes the rest itself — the same catch-up rule as any request.
3. Otherwise D tells its KV receiver to expect the request's uncached blocks and sends `prefill`
   to P with `send_from` (tokens D already holds) and the destination block ids.
4. P pushes K/V layer by layer into those blocks, then sends `prefill_done(first_token)`. When both
   the last layer and the first token are in, the request joins the continuous batch.
5. Tokens stream back as `output` messages to the identity that added the request.
6. `abort` frees the blocks here and tells P to stop. If P fails, refuses, or goes quiet for
   `prefill_timeout_s`, D drops late KV for the request and recomputes it locally: slower, never wrong.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import structlog
import zmq

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import Request, RequestStatus
from tandem.observability.logging import prompts_enabled, request_context
from tandem.observability.trace import Traces
from tandem.observability.worker_metrics import NO_METRICS
from tandem.outputs import RequestOutput
from tandem.protocol.channel import ControlServer, PeerClients
from tandem.sampling_params import SamplingParams
from decode_svc.remote_kv import Released, RemoteKV

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class DecodeStats:
    remote_prefills: int = 0
    local_prefills: int = 0
    fallbacks: int = 0
    last_fallback_reason: str = ""
    transferred_blocks: int = 0
    reused_blocks: int = 0
    errors: int = 0


class DecodeWorker:
    def __init__(self, engine: LLMEngine, listen: str, receiver=None, local_prefill_threshold: int = 0,
                 prefill_timeout_s: float = 30.0, ctx: zmq.Context | None = None,
                 registrar=None) -> None:
        """`receiver`: a KV connector's receiving half over this engine's cache, or None for a
        colocated worker that always prefills itself."""
        self.engine = engine
        self.ctx = ctx or zmq.Context.instance()
        self.server = ControlServer(self.ctx, listen)
        self.peers = PeerClients(self.ctx)
        self.stats = DecodeStats()
        self.traces = Traces()
        self._trace = self.traces.record
        self.remote = RemoteKV(receiver, prefill_timeout_s, self._trace) if receiver is not None else None
        self.local_prefill_threshold = local_prefill_threshold
        self.clients: dict[str, bytes] = {}
        self._after_release: dict[str, str] = {}  # request id -> "abort" | "local", once its KV is released
        self.backlog: deque[tuple[Request, str]] = deque()  # waiting for blocks to receive remote KV into
        self._stopped = False
        self.registrar = registrar  # router registration (issue 5): tandem.protocol.registration.Registrar
        self.obs = NO_METRICS  # observability (issue 8): WorkerMetrics (step/queue/transfer timings), set by the CLI

    @property
    def address(self) -> str:
        return self.server.address

    # ---- loop ------------------------------------------------------------------------------
    def run(self) -> None:
        log.info("decode worker serving", address=self.address,
                 kv=self.remote.address if self.remote else None)
        while not self._stopped:
            self.run_once()

    def stop(self) -> None:
        self._stopped = True

    def run_once(self) -> None:
        sched = self.engine.scheduler
        runnable = bool(sched.running or sched.waiting)
        waiting_kv = bool(sched.remote or self.backlog)
        poller = zmq.Poller()
        poller.register(self.server.sock, zmq.POLLIN)
        self.peers.register(poller)
        poller.poll(0 if runnable else (2 if waiting_kv else 20))
        for identity, msg in self.server.receive():
            with request_context(msg.get("id")):  # observability (issue 8): request_id on every line
                self._safely(self.handle, identity, msg)
        for _peer, msg in self.peers.receive():
            with request_context(msg.get("id")):
                self._safely(self.handle_peer, msg)
        self._dispatch_backlog()
        if self.remote is not None:
            ready, released = self.remote.poll()
            for rid, first_token, first_logprobs in ready:
                self._remote_ready(rid, first_token, first_logprobs)
            for rel in released:
                self._released(rel)
        if sched.running or sched.waiting:
            t0 = time.monotonic()
            outs = self.engine.step()
            self.obs.step_done(self.engine.current_schedule, t0, outs)  # observability (issue 8)
            for out in outs:
                self._send_output(out)
        if self.registrar is not None:  # router registration (issue 5): heartbeat every interval
            self.registrar.tick(self.stats_dict)

    def _safely(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a message must never take the worker down
            self.stats.errors += 1
            log.exception("message handling failed", error=str(exc))

    # ---- control messages ------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict) -> None:
        kind = msg["type"]
        if kind == "add_request":
            self._add(identity, msg)
        elif kind == "abort":
            self._abort(msg["id"])
        elif kind == "stats":
            self.server.reply(identity, "stats_reply", stats=self.stats_dict())
        elif kind == "trace":
            self.server.reply(identity, "trace_reply", id=msg["id"], events=self.traces.get(msg["id"]))
        else:
            self.server.reply(identity, "error", id=msg.get("id"), message=f"a decode worker does not accept {kind!r}")

    def handle_peer(self, msg: dict) -> None:
        if self.remote is None:
            return
        if msg["type"] == "prefill_done":
            rid = msg["id"]
            if self.remote.first_token(rid, msg["first_token"], msg.get("logprobs")):
                self._trace(rid, "prefill_done_ns")
        elif msg["type"] in ("prefill_failed", "error") and msg.get("id"):
            self._fallback(msg["id"], msg.get("message", "prefill peer error"))

    def _add(self, identity: bytes, msg: dict) -> None:
        rid = msg["id"]
        try:
            if rid in self.clients:
                raise ValueError(f"request id {rid!r} is already in use")
            params = SamplingParams.from_dict(msg["sampling"])
            req = self.engine.make_request(rid, msg["token_ids"], params)
        except (ValueError, TypeError) as exc:
            self.server.reply(identity, "error", id=rid, message=str(exc))
            return
        self.clients[rid] = identity
        self.engine.track(req)
        self._trace(rid, "added_ns")
        if prompts_enabled():  # observability (issue 8): prompt text only with --log-prompts
            log.info("request added", prompt_tokens=req.num_prompt_tokens, prefill_peer=msg["prefill_peer"],
                     prompt=self.engine.tokenizer.decode(req.prompt_token_ids))
        else:
            log.debug("request added", prompt_tokens=req.num_prompt_tokens, prefill_peer=msg["prefill_peer"])
        if msg["prefill_peer"] is None or self.remote is None:
            self.engine.scheduler.add(req)  # colocated: this worker prefills
            self.stats.local_prefills += 1
        else:
            self.backlog.append((req, msg["prefill_peer"]))

    def _dispatch_backlog(self) -> None:
        """FCFS: give backlogged requests blocks for their prompt and ask their prefill peer for the KV.
        A request waits here (not computed locally) while D has no room: D's compute is for decoding."""
        sched, bs = self.engine.scheduler, self.engine.config.block_size
        while self.backlog:
            req, peer = self.backlog[0]
            if req.finished:  # aborted while backlogged
                self.backlog.popleft()
                continue
            if not sched.add_remote(req):
                return
            self.backlog.popleft()
            rid, n_cached = req.request_id, req.num_computed_tokens
            self.stats.reused_blocks += n_cached // bs
            if req.num_tokens - n_cached < self.local_prefill_threshold:
                sched.compute_locally(rid)
                self.stats.local_prefills += 1
                continue
            dest_blocks = req.block_ids[n_cached // bs:]
            self.remote.expect(rid, peer, dest_blocks)
            self.obs.request_started(req)  # observability (issue 8): its queue time ends here
            self.stats.remote_prefills += 1
            self.stats.transferred_blocks += len(dest_blocks)
            try:
                self.peers.send(peer, "prefill", id=rid, token_ids=req.prompt_token_ids,
                                sampling=req.params.to_dict(), send_from=n_cached, dest=self.remote.address,
                                dest_block_ids=dest_blocks)
            except ConnectionError as exc:
                self._fallback(rid, str(exc))

    def _abort(self, rid: str) -> None:
        log.info("request aborted")  # observability (issue 8): request_id is bound by run_once
        for i, (req, _) in enumerate(self.backlog):
            if req.request_id == rid:
                del self.backlog[i]
                req.finish_reason, req.status = "abort", RequestStatus.FINISHED
                self._send_output(self.engine.emit(req, []))
                return
        peer = self.remote.cancel(rid) if self.remote is not None else None
        if peer is None:
            out = self.engine.abort_request(rid)
            if out is not None:
                self._send_output(out)
            return
        # KV may still be landing in this request's blocks: answer the client now, free the blocks
        # once the receiver confirms nothing more is written (see _released).
        self._tell_peer(peer, "abort", id=rid)
        self._after_release[rid] = "abort"
        identity = self.clients.pop(rid, None)
        if identity is not None:
            self.server.reply(identity, "output", id=rid, token_ids=[], text="", finished=True,
                              finish_reason="abort", num_cached_tokens=0, num_prompt_tokens=0)

    # ---- remote KV ---------------------------------------------------------------------------
    def _remote_ready(self, rid: str, first_token: int, first_logprobs: list | None = None) -> None:
        req = self.engine.scheduler.remote.get(rid)
        if req is None:
            return
        self._trace(rid, "kv_ready_ns")
        self.obs.transfer_done(self.traces.get(rid))  # observability (issue 8)
        before = req.num_tokens
        self.engine.scheduler.remote_kv_arrived(rid, first_token)
        if req.logprobs is not None:  # P sampled the first token: its logprobs came with prefill_done
            req.logprobs.append({int(t): float(lp) for t, lp in first_logprobs or []} or {first_token: float("nan")})
        self._send_output(self.engine.emit(req, req.token_ids[before:]))

    def _fallback(self, rid: str, reason: str) -> None:
        """P failed or refused: stop its KV and recompute the prompt here once the blocks are ours again."""
        if self.remote is None or rid in self._after_release:
            return
        peer = self.remote.cancel(rid)
        if peer is None:
            return
        log.warning("prefill fallback: recomputing locally", request_id=rid, reason=reason)
        self.stats.last_fallback_reason = reason
        self._tell_peer(peer, "abort", id=rid)
        self._after_release[rid] = "local"

    def _released(self, rel: Released) -> None:
        """A remote request's blocks are safe to reuse: finish what was decided for it."""
        action = self._after_release.pop(rel.request_id, "local")
        if rel.request_id not in self.engine.scheduler.remote:
            return
        if action == "abort":
            self.engine.abort_request(rel.request_id)
            return
        if not rel.cancelled_by_us:
            log.warning("prefill fallback: recomputing locally", request_id=rel.request_id, reason=rel.reason)
            self.stats.last_fallback_reason = rel.reason
        self.stats.fallbacks += 1
        self.engine.scheduler.compute_locally(rel.request_id)

    def _tell_peer(self, peer: str, kind: str, **fields) -> None:
        try:
            self.peers.send(peer, kind, **fields)
        except ConnectionError:
            pass  # a dead peer needs no abort

    # ---- outputs -----------------------------------------------------------------------------
    def _send_output(self, out: RequestOutput) -> None:
        identity = self.clients.get(out.request_id)
        if identity is None:
            return
        if out.finished:
            del self.clients[out.request_id]
            self._trace(out.request_id, "finished_ns")
        fields = dict(id=out.request_id, token_ids=out.new_token_ids, text=out.text_delta, finished=out.finished,
                      finish_reason=out.finish_reason, num_cached_tokens=out.num_cached_tokens,
                      num_prompt_tokens=len(out.prompt_token_ids))
        if out.finished:
            fields["stop_reason"] = out.outputs[0].stop_reason
            queue_time = self.obs.queue_time(out.request_id)  # observability (issue 8): for the router's histogram
            if queue_time is not None:
                fields["queue_time_s"] = queue_time
            log.info("request finished", request_id=out.request_id, finish_reason=out.finish_reason,
                     prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens,
                     output_tokens=len(out.outputs[0].token_ids))
        logprobs = out.outputs[0].logprobs
        if logprobs is not None and out.new_token_ids:
            # Per new token: [[token_id, logprob], ...] (msgpack maps here need string keys).
            fields["logprobs"] = [[[t, lp] for t, lp in entry.items()]
                                  for entry in logprobs[-len(out.new_token_ids):]]
        self.server.reply(identity, "output", **fields)

    def stats_dict(self) -> dict:
        sched, kv = self.engine.scheduler, self.engine.kv.stats()
        s = self.stats
        out = {
            "role": "decode", "running": len(sched.running), "waiting": len(sched.waiting),
            "waiting_for_kv": len(sched.remote), "backlog": len(self.backlog), "kv_blocks_total": kv.num_blocks, "kv_blocks_used": kv.used_blocks,
            "kv_usage": kv.usage, "prefix_queried_tokens": kv.prefix_queried_tokens,
            "prefix_hit_tokens": kv.prefix_hit_tokens, "preemptions": sched.num_preemptions,
            "remote_prefills": s.remote_prefills, "local_prefills": s.local_prefills, "fallbacks": s.fallbacks,
            "last_fallback_reason": s.last_fallback_reason,
            "transferred_blocks": s.transferred_blocks, "reused_blocks": s.reused_blocks,
            "bad_messages": self.server.bad_frames, "errors": s.errors,
        }
        if self.remote is not None:
            out.update(self.remote.stats())
        return out

    def close(self) -> None:
        self.server.close()
        self.peers.close()
        if self.remote is not None:
            self.remote.close()
