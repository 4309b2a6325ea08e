"""DecodeWorker: one request's path through a decode worker (D). The engine and its KV connector
(decode_svc/kv_connector.py) do the work; this file carries messages.

1. `add_request` arrives on the control socket; sampling and prompt are validated (a bad one is
   answered with `error`, nothing else changes). The request goes into the engine's waiting queue
   with its prefill peer (`prefill_peer`, None: this worker prefills it, colocated).
2. The scheduler admits it under `max_num_seqs` and priority like any request. With a peer and
   at least `local_prefill_threshold` uncached tokens, it gets blocks for its prompt and the
   connector sends `prefill` to P; otherwise this worker computes the prompt itself.
3. P pushes K/V layer by layer into those blocks and completes the transfer with the first token;
   the request joins the continuous batch in the engine's next step.
4. Tokens stream back as `output` messages to the identity that added the request.
5. `abort` ends the request at once for the client; its blocks are freed once nothing can write
   into them any more. If P refuses (`prefill_failed`), dies or goes quiet for `prefill_timeout_s`,
   the engine recomputes the prompt here: slower, never wrong. A killed or stopped P is noticed
   within ~2 s (PeerClients' heartbeats), not after the timeout.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import zmq

from decode_svc.kv_connector import DecodeKVConnector
from tandem.engine.llm_engine import LLMEngine
from tandem.observability.logging import prompts_enabled, request_context
from tandem.observability.trace import Traces
from tandem.observability.worker_metrics import NO_METRICS
from tandem.outputs import RequestOutput
from tandem.protocol.channel import ControlServer, PeerClients
from tandem.sampling_params import BeamSearchParams, SamplingParams

log = structlog.get_logger(__name__)


class DecodeWorker:
    def __init__(self, engine: LLMEngine, listen: str | ControlServer, receiver=None, local_prefill_threshold: int = 0,
                 prefill_timeout_s: float = 30.0, ctx: zmq.Context | None = None, registrar=None) -> None:
        """`receiver`: a KV transport's receiving half over this engine's cache, or None for a
        colocated worker that always prefills itself."""
        self.engine = engine
        self.ctx = ctx or zmq.Context.instance()
        # a ControlServer is handed over when this worker takes the role over from another (role switch)
        self.server = listen if isinstance(listen, ControlServer) else ControlServer(self.ctx, listen)
        self.lifecycle: dict | None = None  # a `set_role` / `drain` from the router, acted on by serve()
        self.peers = PeerClients(self.ctx)
        self.traces = Traces()
        self._trace = self.traces.record
        self.kv: DecodeKVConnector | None = None
        if receiver is not None:
            self.kv = DecodeKVConnector(receiver, self.peers.send, engine.config.block_size,
                                        local_prefill_threshold, prefill_timeout_s, self._on_transfer_event,
                                        on_remote_start=lambda req: self.obs.request_started(req))
            engine.set_kv_connector(self.kv)
        self.clients: dict[str, bytes] = {}
        self.added = 0
        self.errors = 0
        self._stopped = False
        self.registrar = registrar  # tandem.protocol.registration.Registrar, or None when not registered
        self.obs = NO_METRICS  # WorkerMetrics (step/queue/transfer timings), set by the CLI

    @property
    def address(self) -> str:
        return self.server.address

    # ---- loop ------------------------------------------------------------------------------
    def run(self, until=None) -> None:
        """Serve until stop(), or until `until()` is true (checked after every iteration)."""
        log.info("decode worker serving", address=self.address, kv=self.kv.address if self.kv else None)
        while not self._stopped and not (until is not None and until()):
            self.run_once()

    def idle(self) -> bool:
        """Nothing in flight: no request, no transfer, no held blocks."""
        return not self.engine.has_unfinished_requests() and not (self.kv is not None and self.kv.has_pending)

    def stop(self) -> None:
        self._stopped = True

    def run_once(self) -> None:
        runnable = self.engine.has_runnable()
        waiting_kv = self.kv is not None and self.kv.has_pending
        poller = zmq.Poller()
        poller.register(self.server.sock, zmq.POLLIN)
        self.peers.register(poller)
        kv_fd = self.kv.receiver.ready_fd if self.kv is not None else None
        if kv_fd is not None:  # P's `done` wakes this loop at once: the first token goes out without a timer tick
            poller.register(kv_fd, zmq.POLLIN)
        ready = dict(poller.poll(0 if runnable else (2 if waiting_kv else 20)))
        kv_woke = kv_fd is not None and kv_fd in ready  # a step's connector poll reads (and clears) it
        for identity, msg in self.server.receive():
            with request_context(msg.get("id")):  # the request id on every log line
                self._safely(self.handle, identity, msg)
        for _peer, msg in self.peers.receive():
            with request_context(msg.get("id")):
                self._safely(self.handle_peer, msg)
        for peer in self.peers.lost():
            if self.kv is not None:
                self.kv.peer_gone(peer)
        if runnable or waiting_kv or kv_woke:
            t0 = time.monotonic()
            outs = self.engine.step()
            self.obs.step_done(self.engine.current_schedule, t0, outs)
            for out in outs:
                self._send_output(out)
        if self.registrar is not None:  # progress for the router; liveness has its own thread
            self.registrar.tick(self.stats_dict)

    def _safely(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a message must never take the worker down
            self.errors += 1
            log.exception("message handling failed", error=str(exc))

    # ---- control messages ------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict) -> None:
        kind = msg["type"]
        if kind == "add_request":
            self._add(identity, msg)
        elif kind == "abort":
            log.info("request aborted")
            out = self.engine.abort_request(msg["id"])
            if out is not None:
                self._send_output(out)
        elif kind == "stats":
            self.server.reply(identity, "stats_reply", stats=self.stats_dict())
        elif kind == "trace":
            self.server.reply(identity, "trace_reply", id=msg["id"], events=self.traces.get(msg["id"]))
        elif kind in ("set_role", "drain"):
            self.lifecycle = msg
        else:
            self.server.reply(identity, "error", id=msg.get("id"), message=f"a decode worker does not accept {kind!r}")

    def handle_peer(self, msg: dict) -> None:
        if self.kv is not None and msg["type"] in ("prefill_failed", "error") and msg.get("id"):
            self.kv.peer_failed(msg["id"], msg.get("message", "prefill peer error"))

    def _add(self, identity: bytes, msg: dict) -> None:
        rid = msg["id"]
        try:
            if rid in self.clients:
                raise ValueError(f"request id {rid!r} is already in use")
            if msg.get("beam") is not None:  # a beam search: its group expands here (tandem/engine/beam_group.py)
                req = self.engine.make_beam_request(rid, msg["token_ids"], BeamSearchParams.from_dict(msg["beam"]))
            else:
                req = self.engine.make_request(rid, msg["token_ids"], SamplingParams.from_dict(msg["sampling"]))
        except (ValueError, TypeError) as exc:
            self.server.reply(identity, "error", id=rid, message=str(exc))
            return
        req.kv_peer = msg["prefill_peer"] if self.kv is not None else None
        self.clients[rid] = identity
        self.added += 1
        self.engine.enqueue(req)
        self._trace(rid, "added_ns")
        fields: dict[str, Any] = {"prompt_tokens": req.num_prompt_tokens, "prefill_peer": msg["prefill_peer"]}
        if prompts_enabled():  # prompt text only with --log-prompts
            log.info("request added", **fields, prompt=self.engine.tokenizer.decode(req.prompt_token_ids))
        else:
            log.debug("request added", **fields)

    def _on_transfer_event(self, rid: str, event: str, t_ns: int | None = None) -> None:
        self._trace(rid, event, t_ns) if t_ns is not None else self._trace(rid, event)
        if event == "kv_ready_ns":
            self.obs.transfer_done(self.traces.get(rid))

    # ---- outputs -----------------------------------------------------------------------------
    def _send_output(self, out: RequestOutput) -> None:
        identity = self.clients.get(out.request_id)
        if identity is None:
            return
        if out.finished:
            del self.clients[out.request_id]
            self._trace(out.request_id, "finished_ns")
        self._trace(out.request_id, "first_output_ns")  # kept once: when its first token left for the router
        fields = dict(id=out.request_id, token_ids=out.new_token_ids, text=out.text_delta, finished=out.finished,
                      finish_reason=out.finish_reason, num_cached_tokens=out.num_cached_tokens,
                      num_prompt_tokens=len(out.prompt_token_ids))
        if out.finished:
            fields["stop_reason"] = out.outputs[0].stop_reason
            queue_time = self.obs.queue_time(out.request_id)  # for the router's histogram
            if queue_time is not None:
                fields["queue_time_s"] = queue_time
            log.info("request finished", request_id=out.request_id, finish_reason=out.finish_reason,
                     prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens,
                     output_tokens=len(out.outputs[0].token_ids))
        if out.outputs[0].cumulative_logprob is not None:  # a beam search's hypotheses, best first
            fields["beams"] = [{"token_ids": c.token_ids, "text": c.text, "cumulative_logprob": c.cumulative_logprob,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        logprobs = out.outputs[0].logprobs
        if logprobs is not None and out.new_token_ids:
            # Per new token: [[token_id, logprob], ...] (msgpack maps here need string keys).
            fields["logprobs"] = [[[t, lp] for t, lp in entry.items()]
                                  for entry in logprobs[-len(out.new_token_ids):]]
        if out.prompt_logprobs is not None and len(out.outputs[0].token_ids) == len(out.new_token_ids):
            # once, with the first output: [[token_id, logprob], ...] per prompt token, None for the first
            fields["prompt_logprobs"] = [None if e is None else [[t, lp] for t, lp in e.items()]
                                         for e in out.prompt_logprobs]
        self.server.reply(identity, "output", **fields)

    def stats_dict(self) -> dict:
        out = {
            "role": "decode", **self.engine.stats(), "bad_messages": self.server.bad_frames, "errors": self.errors,
            "remote_prefills": 0, "local_prefills": 0, "fallbacks": 0, "last_fallback_reason": "",
            "transferred_blocks": 0, "reused_blocks": 0,
        }
        if self.kv is not None:
            out.update(self.kv.stats_dict())
        else:  # colocated: every prompt is computed here
            out["local_prefills"] = self.added
        return out

    def release_role(self) -> None:
        """Close what only the decode role uses (peer links, the KV receiver); the engine and control
        socket stay."""
        self.peers.close()
        if self.kv is not None:
            self.kv.close()

    def close(self) -> None:
        self.release_role()
        self.server.close()
