"""The router core: one request's lifecycle through the router (both front ends share it).

1. A front end (HTTP or gRPC) validates the request, tokenizes it (prompts.py) and calls
   `submit(token_ids, params, request_id)`.
2. Admission: beyond `max_inflight` unfinished requests the call fails at once with Overloaded
   (HTTP 429 / RESOURCE_EXHAUSTED, with a retry-after) — nothing is queued, so load beyond
   capacity costs a rejection, not memory. A client request id already in flight is a BadRequest.
3. Dispatch: the decode policy picks a live D, the prefill policy a live P (none registered:
   D computes the prompt itself, colocated), and `add_request(id, token_ids, sampling,
   prefill_peer=P)` goes to D. No live D: NoWorkers (HTTP 503 / UNAVAILABLE).
   Conditional disaggregation: a prompt of at most `local_prefill_if_busy` tokens whose P already
   has a prompt in flight goes to an idle P if there is one, else to D without a peer — D computes it
   now (mixed into its decode steps) instead of queueing behind a prefill; longer prompts always wait
   for the chosen P, which is what keeps D's streams smooth.
4. D streams `output` messages back on the router's link to it; each becomes a Chunk on the
   request's queue, which the front end drains (`Stream`). An `error` from D before any token is a
   BadRequest (D's validation), after tokens an internal error.
5. The last output (finished) frees the admission slot at once, whether or not the client has read it.
6. `Stream.close()` before the end (client cancelled or disconnected) sends `abort` to D, which
   frees the blocks on D and tells P to stop.
7. D refuses a request it never ran (it has just switched roles), or is declared lost (dead or
   hung): the request goes to another D, or its stream is migrated there (router_svc/failover.py).
   A D that is merely slow (a long step) is not lost: it gets fewer new requests
   (`Registry.routable`) and keeps its streams.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import structlog

from router_svc import metrics
from router_svc.errors import BadRequest, NoWorkers, Overloaded, RouterError
from router_svc.failover import Failover
from router_svc.registry import Registry, Worker
from tandem.engine.interfaces.routing import RouteRequest, RoutingPolicy, prefix_key
from tandem.sampling_params import BeamSearchParams, SamplingParams

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Chunk:
    """One `output` message from D, as the front ends see it."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: Any = None
    prompt_logprobs: Any = None  # with the first chunk, when asked: per prompt token [[id, logprob], ...] or None
    beams: Any = None  # a beam search's (last and only) chunk: its hypotheses, best first


@dataclass(slots=True)
class Flight:
    """A request between admission and its end."""

    rid: str
    token_ids: list[int]  # what D is asked to continue: the prompt (+ the tokens sent, after a migration)
    sampling: dict[str, Any]
    route: RouteRequest
    log: Any
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    decode: Worker | None = None
    prefill: Worker | None = None  # counted in its inflight until the first token arrives
    tokens_out: int = 0
    generated: list[int] = field(default_factory=list)  # token ids already handed to the client
    prompt_len: int = 0  # the client's prompt, for usage after a migration
    max_tokens: int = 16  # the client's max_tokens (sampling["max_tokens"] shrinks with each migration)
    attempts: int = 0
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    stats: metrics.FlightStats = field(default_factory=metrics.FlightStats)
    beam: dict[str, Any] | None = None  # BeamSearchParams.to_dict() of a beam search


class Router(Failover):
    def __init__(self, registry: Registry, send: Callable[..., None], decode_policy: RoutingPolicy,
                 prefill_policy: RoutingPolicy, max_inflight: int = 256, block_size: int = 16,
                 affinity_blocks: int = 4, retry_after_s: int = 1, migrate: bool = True,
                 local_prefill_if_busy: int = 0) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if local_prefill_if_busy < 0:
            raise ValueError(f"local_prefill_if_busy must be >= 0, got {local_prefill_if_busy}")
        self.registry = registry
        self.send = send  # send(address, msg_type, **fields); raises ConnectionError
        self.decode_policy = decode_policy
        self.prefill_policy = prefill_policy
        self.max_inflight = max_inflight
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.retry_after_s = retry_after_s
        self.migrate = migrate
        self.local_prefill_if_busy = local_prefill_if_busy
        self.draining = False  # shutting down: new requests are refused, those in flight finish
        self.flights: dict[str, Flight] = {}

    # ---- 1-3: admission and dispatch --------------------------------------------------------------
    def submit(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
               beam: BeamSearchParams | None = None) -> "Stream":
        if self.draining:
            raise NoWorkers("the server is shutting down; retry on another replica")
        if len(self.flights) >= self.max_inflight:
            raise Overloaded(f"the server is at its limit of {self.max_inflight} requests in flight; retry later",
                             retry_after_s=self.retry_after_s)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self.flights:
            raise BadRequest(f"request_id {rid!r} is already in flight", param="request_id")
        route = RouteRequest(rid, token_ids, prefix_key(token_ids, self.block_size, self.affinity_blocks))
        flight = Flight(rid, list(token_ids), params.to_dict(), route, log.bind(request_id=rid),
                        prompt_len=len(token_ids), max_tokens=params.max_tokens,
                        beam=beam.to_dict() if beam is not None else None)
        self._dispatch(flight, exclude=set())
        self.flights[rid] = flight
        metrics.IN_FLIGHT.set(len(self.flights))
        return Stream(self, flight)

    def _dispatch(self, flight: Flight, exclude: set[str]) -> None:
        while True:
            decoders = [w for w in self.registry.routable("decode") if w.worker_id not in exclude]
            if not decoders:
                raise NoWorkers("no decode worker is available" + (" (the one serving this request was lost)"
                                                                   if flight.attempts else ""))
            d = cast(Worker, self.decode_policy.choose(decoders, flight.route))  # it picks one of ours
            prefills = self.registry.routable("prefill")
            p = cast(Worker, self.prefill_policy.choose(prefills, flight.route)) if prefills else None
            if p is not None and p.inflight > 0 and len(flight.token_ids) <= self.local_prefill_if_busy:
                idle = [w for w in prefills if w.inflight == 0]
                if idle:  # another P is free: it computes the prompt now, and D's streams stay undisturbed
                    p = cast(Worker, self.prefill_policy.choose(idle, flight.route))
                else:  # every P is busy and the prompt is short: D computes it sooner than a P would
                    p = None
                    metrics.LOCAL_WHEN_BUSY.inc()
            try:
                self.send(d.address, "add_request", id=flight.rid, token_ids=flight.token_ids,
                          sampling=flight.sampling, prefill_peer=p.address if p is not None else None,
                          beam=flight.beam)
            except ConnectionError as exc:
                flight.log.warning("decode worker refused the request", worker_id=d.worker_id, error=str(exc))
                exclude.add(d.worker_id)
                continue
            flight.decode, flight.prefill, flight.attempts = d, p, flight.attempts + 1
            d.inflight += 1
            metrics.routed("decode", self.decode_policy, d)
            if p is not None:
                p.inflight += 1
                metrics.routed("prefill", self.prefill_policy, p)
            flight.log.debug("dispatched", decode=d.worker_id, prefill=p.worker_id if p else None)
            return

    # ---- 4-5: messages from decode workers -------------------------------------------------------
    def on_worker_message(self, address: str, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "stats_reply":
            self.registry.on_stats_reply(address, msg["stats"])
            return
        flight = self.flights.get(msg.get("id") or "")
        if flight is None or flight.done or flight.decode is None or flight.decode.address != address:
            if kind == "error" and msg.get("id") is None:
                log.warning("error from worker", worker=address, message=msg.get("message"))
            return  # late output of an aborted / retried request
        if kind == "output":
            self._on_output(flight, msg)
        elif kind == "error":
            if msg.get("retry") and flight.tokens_out == 0:
                self._redispatch(flight)
            elif flight.tokens_out == 0:
                self._end(flight, BadRequest.from_exception(ValueError(msg["message"])))
            else:
                self._end(flight, RouterError(f"the decode worker failed the request: {msg['message']}"))

    def _on_output(self, flight: Flight, msg: dict[str, Any]) -> None:
        self._release_prefill(flight)
        metrics.on_output(flight, msg)  # TTFT, ITL, tokens, e2e, queue time
        flight.tokens_out += len(msg["token_ids"])
        flight.generated += msg["token_ids"]
        chunk = Chunk(msg["token_ids"], msg["text"], msg["finished"], msg["finish_reason"], msg.get("stop_reason"),
                      flight.prompt_len, msg["num_cached_tokens"], msg.get("logprobs"),
                      msg.get("prompt_logprobs") if flight.tokens_out == len(msg["token_ids"]) else None,
                      msg.get("beams"))
        if chunk.finished:
            self._end(flight, chunk)
        else:
            flight.queue.put_nowait(chunk)

    def _end(self, flight: Flight, last: Chunk | RouterError) -> None:
        """Last item for the client; frees the admission slot and the worker counts."""
        flight.done = True
        flight.queue.put_nowait(last)
        self._release_prefill(flight)
        if flight.decode is not None:
            flight.decode.inflight -= 1
        self.flights.pop(flight.rid, None)
        metrics.IN_FLIGHT.set(len(self.flights))

    def _release_prefill(self, flight: Flight) -> None:
        if flight.prefill is not None:
            flight.prefill.inflight -= 1
            flight.prefill = None

    # ---- 6: cancel ------------------------------------------------------------------------------
    def abort(self, flight: Flight) -> None:
        if flight.done:
            return
        flight.log.info("aborting", decode=flight.decode.worker_id if flight.decode else None,
                        tokens_out=flight.tokens_out)
        if flight.decode is not None:
            try:
                self.send(flight.decode.address, "abort", id=flight.rid)
            except ConnectionError:
                pass  # D is unreachable: its own expiry frees nothing here, and its blocks die with it
        self._end(flight, RouterError("the request was cancelled"))

    def describe(self) -> dict[str, Any]:
        return {"in_flight": len(self.flights), "max_inflight": self.max_inflight, "draining": self.draining}


class Stream:
    """What a front end reads: Chunks until one is finished; raises the RouterError that ended it."""

    def __init__(self, router: Router, flight: Flight) -> None:
        self.router = router
        self.flight = flight
        self._ended = False

    @property
    def request_id(self) -> str:
        return self.flight.rid

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        item = await self.flight.queue.get()
        if isinstance(item, RouterError):
            self._ended = True
            raise item
        if item.finished:
            self._ended = True
        return item

    def close(self) -> None:
        """Always call when done (finally:); before the end it aborts the request on D."""
        self._ended = True
        self.router.abort(self.flight)
