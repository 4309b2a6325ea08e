"""PrefillWorker: one request's path through a prefill worker (P).

1. `prefill(id, token_ids, sampling, send_from, dest, dest_block_ids)` arrives from a decode worker D.
   It is validated (block count must match the prompt; the KV handshake with `dest` must agree on
   model, dtype, block size, layers, heads) — a failure is answered with `prefill_failed`.
2. The request is scheduled like any other (P's own prefix cache, chunked prefill, batched with
   others) with `max_tokens=1`: a prefill-role request is done after its first token.
3. The engine's KV connector (prefill_svc/kv_connector.py) pushes each layer's finished blocks to
   D's `dest_block_ids` as the forward pass stores them — the transfer overlaps compute.
4. When the first token is sampled, the connector completes the transfer with it (`done` carries
   the first token and its logprobs); P's blocks return to its prefix cache (reusable, evictable).
5. `abort` from D removes the request and stops sending for it.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import structlog
import zmq

from prefill_svc.kv_connector import PrefillKVConnector
from tandem.engine.llm_engine import LLMEngine
from tandem.observability.logging import prompts_enabled, request_context
from tandem.observability.trace import Traces
from tandem.observability.worker_metrics import NO_METRICS
from tandem.protocol.channel import ControlServer
from tandem.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


class PrefillWorker:
    def __init__(self, engine: LLMEngine, listen: str | ControlServer, sender, ctx: zmq.Context | None = None,
                 registrar=None) -> None:
        self.engine = engine
        self.ctx = ctx or zmq.Context.instance()
        # a ControlServer is handed over when this worker takes the role over from another (role switch)
        self.server = listen if isinstance(listen, ControlServer) else ControlServer(self.ctx, listen)
        self.lifecycle: dict | None = None  # a `set_role` / `drain` from the router, acted on by serve()
        self.sender = sender
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-handshake")
        # destination -> (its receiver instance, connect()); connect() is idempotent once it succeeded
        self._handshakes: dict[str, tuple[str | None, Future]] = {}
        self._awaiting: dict[str, tuple[bytes, dict, Future]] = {}  # request id -> waiting for its handshake
        self.traces = Traces()
        self._trace = self.traces.record
        self.counters = {"failed": 0, "aborted": 0, "errors": 0}
        self._stopped = False
        self.registrar = registrar  # tandem.protocol.registration.Registrar, or None when not registered
        self.obs = NO_METRICS  # WorkerMetrics (step/queue timings), set by the CLI
        self.kv = PrefillKVConnector(sender, engine.config.block_size, engine.kv_layout.num_layers, self._trace,
                                     on_stuck=self._give_up)
        engine.set_kv_connector(self.kv)

    @property
    def address(self) -> str:
        return self.server.address

    def run(self, until=None) -> None:
        """Serve until stop(), or until `until()` is true (checked after every iteration)."""
        log.info("prefill worker serving", address=self.address)
        while not self._stopped and not (until is not None and until()):
            self.run_once()

    def idle(self) -> bool:
        """Nothing in flight: no request scheduled or waiting for its KV handshake."""
        return not self.engine.has_unfinished_requests() and not self._awaiting

    def stop(self) -> None:
        self._stopped = True

    def run_once(self) -> None:
        busy = self.engine.has_runnable()
        self.server.sock.poll(0 if busy else (2 if self._awaiting or self.kv.has_pending else 20))
        for identity, msg in self.server.receive():
            with request_context(msg.get("id")):  # the request id on every log line
                try:
                    self.handle(identity, msg)
                except Exception as exc:  # never let one message take the worker down
                    self.counters["errors"] += 1
                    log.exception("message handling failed", error=str(exc))
        self._admit_handshaken()
        if self.engine.has_runnable() or self.kv.has_pending:  # a step's poll frees the blocks D acknowledged
            t0 = time.monotonic()
            outs = self.engine.step()
            self.obs.step_done(self.engine.current_schedule, t0, outs)
        if self.registrar is not None:  # progress for the router; liveness has its own thread
            self.registrar.tick(self.stats_dict)

    # ---- control messages --------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict) -> None:
        kind = msg["type"]
        if kind == "prefill":
            self._prefill(identity, msg)
        elif kind == "abort":
            self._awaiting.pop(msg["id"], None)
            if self.kv.cancel(msg["id"]):
                self.counters["aborted"] += 1
                self.engine.abort_request(msg["id"])
        elif kind == "stats":
            self.server.reply(identity, "stats_reply", stats=self.stats_dict())
        elif kind == "trace":
            self.server.reply(identity, "trace_reply", id=msg["id"], events=self.traces.get(msg["id"]))
        elif kind in ("set_role", "drain"):
            self.lifecycle = msg
        elif kind == "decode_lost":  # the router declared that decode worker dead or hung
            if msg["dest"] in self._handshakes:
                log.warning("decode worker lost: dropping its KV link", dest=msg["dest"])
                self._give_up(msg["dest"])
        else:
            # An add_request here was routed before the router saw this worker leave the decode role
            # (a role switch): nothing of it ran, so the router may send it to another decode worker.
            self.server.reply(identity, "error", id=msg.get("id"), message=f"a prefill worker does not accept {kind!r}",
                              retry=kind == "add_request")

    def _prefill(self, identity: bytes, msg: dict) -> None:
        """Start the KV handshake with D off the loop (an unreachable `dest` must not stall P);
        `_admit_handshaken` schedules the request once it is done."""
        dest = msg["dest"]
        if len(self._awaiting) >= 1024:  # bounded: a flood of prefills to dead peers cannot grow memory
            self.server.reply(identity, "prefill_failed", id=msg["id"], message="too many pending KV handshakes")
            return
        instance = msg.get("dest_instance")
        known, fut = self._handshakes.get(dest, (None, None))
        if fut is not None and known != instance and fut.done():  # D restarted at the same address
            log.info("decode worker restarted: handshaking again", dest=dest)
            self.sender.disconnect(dest)
            fut = None
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(self.sender.connect, dest)
            self._handshakes[dest] = (instance, fut)
        self._awaiting[msg["id"]] = (identity, msg, fut)

    def _admit_handshaken(self) -> None:
        for rid, (identity, msg, fut) in list(self._awaiting.items()):
            if not fut.done():
                continue
            del self._awaiting[rid]
            try:
                fut.result()  # a layout mismatch (HandshakeError) is the real error: report it first
                req, send_from = self._validated(msg)
            except Exception as exc:  # D falls back to computing locally
                self.counters["failed"] += 1
                log.warning("prefill refused", request_id=rid, dest=msg["dest"], error=str(exc))
                self.server.reply(identity, "prefill_failed", id=rid, message=str(exc))
                continue
            self.kv.expect_push(rid, msg["dest"], send_from, msg["dest_block_ids"])
            self._trace(rid, "received_ns")
            if prompts_enabled():  # prompt text only with --log-prompts
                log.info("prefill admitted", request_id=rid, prompt_tokens=req.num_prompt_tokens, send_from=send_from,
                         prompt=self.engine.tokenizer.decode(req.prompt_token_ids))
            else:
                log.debug("prefill admitted", request_id=rid, prompt_tokens=req.num_prompt_tokens, send_from=send_from)
            self.engine.enqueue(req)

    def _validated(self, msg: dict):
        bs = self.engine.config.block_size
        params = SamplingParams.from_dict(msg["sampling"])
        # P samples the first token only: with min_tokens >= 1 that token must not end the request
        params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        req = self.engine.make_request(msg["id"], msg["token_ids"], params)
        send_from = msg["send_from"]
        if send_from % bs or not 0 <= send_from < req.num_tokens:
            raise ValueError(f"send_from={send_from} must be a multiple of {bs} below the prompt length")
        n_blocks = -(-req.num_tokens // bs) - send_from // bs
        if len(msg["dest_block_ids"]) != n_blocks:
            raise ValueError(f"expected {n_blocks} destination blocks, got {len(msg['dest_block_ids'])}")
        return req, send_from

    def stats_dict(self) -> dict:
        out = {"role": "prefill", **self.engine.stats(), "bad_messages": self.server.bad_frames,
               "prefills": self.kv.completed, **self.counters}
        st = self.sender.stats
        out.update(kv_bytes_sent=st.bytes_sent, kv_transfers=st.transfers, kv_transfer_failures=st.failures)
        return out

    def _give_up(self, dest: str) -> None:
        """D never acknowledged lent blocks: drop the link (the next prefill for it handshakes anew)."""
        self._handshakes.pop(dest, None)
        self.sender.disconnect(dest)

    def release_role(self) -> None:
        """Close what only the prefill role uses (the KV sender); the engine and control socket stay."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.sender.close()  # resolves every unfinished transfer: nothing reads the lent blocks any more
        for rid in self.kv.poll().released:  # the next role's connector would never release them
            self.engine.scheduler.release(rid)

    def close(self) -> None:
        self.release_role()
        self.server.close()
