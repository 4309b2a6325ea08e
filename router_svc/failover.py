"""What the router does when a decode worker cannot carry a request on (the router core's step 7).

- D refused a request it never ran (an `error` with `retry`: it had just switched to the prefill
  role when the request arrived): the request goes to another D as if it had been routed there.
- D is declared lost (dead: missed heartbeats; or hung: no progress for the hung timeout): a request
  that has not handed any token to its client yet is dispatched again on another D; one that has is
  migrated (prompt + the tokens already streamed become the new D's prompt, the stream continues).

A mixin of `router_svc.core.Router`, kept apart so each file reads on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, cast

from router_svc import metrics
from router_svc.errors import NoWorkers, RouterError, WorkerLost
from router_svc.registry import Worker

if TYPE_CHECKING:
    from router_svc.core import Chunk, Flight


class Failover:
    flights: dict[str, "Flight"]
    migrate: bool
    send: Callable[..., None]

    def _dispatch(self, flight: "Flight", exclude: set[str]) -> None: ...
    def _end(self, flight: "Flight", last: "Chunk | RouterError") -> None: ...
    def _release_prefill(self, flight: "Flight") -> None: ...

    def _redispatch(self, flight: "Flight") -> None:
        """D refused the request without running any of it (it has just left the decode role): route
        nothing more to it and send the request to another D (none: the request ends with NoWorkers)."""
        refused = cast(Worker, flight.decode)
        refused.inflight -= 1
        refused.stats = {**refused.stats, "draining": True}
        self._release_prefill(flight)
        try:
            self._dispatch(flight, exclude={refused.worker_id})
        except NoWorkers as exc:
            flight.decode = None
            self._end(flight, exc)
            return
        metrics.RETRIES.inc()
        flight.log.info("re-routed a request the decode worker refused", refused=refused.worker_id,
                        decode=flight.decode.worker_id if flight.decode else None)

    # ---- 7: lost workers -------------------------------------------------------------------------
    def on_worker_lost(self, worker: Worker) -> None:
        for flight in list(self.flights.values()):
            if flight.prefill is worker:
                self._release_prefill(flight)  # D notices P's silence and computes the prompt itself
            if flight.decode is not worker:
                continue
            worker.inflight -= 1
            try:  # in case it is only slow: it should stop computing for nobody
                self.send(worker.address, "abort", id=flight.rid)
            except ConnectionError:
                pass
            flight.decode = None
            if flight.tokens_out and self.migrate and self._migrate(flight, worker):
                continue
            if flight.tokens_out:
                flight.log.warning("decode worker lost mid-stream", worker_id=worker.worker_id,
                                   tokens_out=flight.tokens_out)
                what = (f"is hung (no progress for {worker.loop_age_s():.0f}s)" if worker.hung
                        else "stopped responding")
                self._end(flight, WorkerLost(
                    f"decode worker {worker.worker_id} {what} after {flight.tokens_out} tokens had been sent; "
                    "the request cannot be resumed, please retry it"))
                continue
            self._release_prefill(flight)
            try:
                self._dispatch(flight, exclude={worker.worker_id})
                metrics.RETRIES.inc()
                flight.log.info("retried on another decode worker", lost=worker.worker_id,
                                decode=flight.decode.worker_id if flight.decode else None)
            except NoWorkers as exc:
                self._end(flight, exc)

    def _migrate(self, flight: "Flight", lost: Worker) -> bool:
        """Continue a stream on another D: prompt + tokens sent so far become its prompt."""
        self._release_prefill(flight)
        remaining = flight.max_tokens - flight.tokens_out
        if remaining < 1:
            return False
        before = (flight.token_ids, flight.sampling)
        flight.token_ids = flight.token_ids[:flight.prompt_len] + flight.generated
        # the prompt's logprobs went out with the first chunk: the new D is not asked again
        flight.sampling = {**flight.sampling, "max_tokens": remaining,
                           "prompt_logprobs": None if flight.tokens_out else flight.sampling.get("prompt_logprobs")}
        if flight.sampling.get("structured_outputs"):  # the grammar resumes after the tokens already sent
            flight.sampling["structured_outputs"] = {**flight.sampling["structured_outputs"],
                                                     "resume_tokens": flight.tokens_out}
        try:
            self._dispatch(flight, exclude={lost.worker_id})
        except NoWorkers:
            flight.token_ids, flight.sampling = before
            return False
        metrics.MIGRATIONS.inc()
        flight.log.warning("stream migrated to another decode worker", lost=lost.worker_id,
                           decode=flight.decode.worker_id if flight.decode else None, tokens_out=flight.tokens_out)
        return True

