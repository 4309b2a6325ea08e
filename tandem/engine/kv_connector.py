"""The disaggregation seam: what the engine asks of a KV connector, split as vLLM v1 splits it.

A connector moves a prompt's KV cache between engines. The engine owns the KV memory and owns
admission; the connector only says where tokens come from and moves bytes. The services (prefill
and decode workers) build a connector over their sockets and hand it to the engine; after that
they only carry messages.

Scheduler half — consulted by `Scheduler.schedule()` and `Scheduler.finish()`:
- `num_external_tokens(req, num_computed)`: how many of the request's uncached prompt tokens will
  come from a peer (0: compute them here). Asked once, when the request is admitted.
- `on_allocated(req, num_computed)`: the request now holds blocks for its whole prompt and waits,
  counted against `max_num_seqs`, in `WAITING_FOR_REMOTE_KV`; start getting the KV into
  `req.block_ids[num_computed // block_size:]`.
- `hold_blocks(req)`: the request ended (an abort) while a peer may still write into its blocks;
  True makes the scheduler keep them until `KVUpdates.released` names the request.

Worker half — driven by the engine:
- `poll()` at the start of every step: `KVUpdates` of transfers that completed (the prompt's KV is
  in the blocks, and the first token the peer sampled rides with it), failed (recompute locally:
  slower, never wrong) or were released after a hold.
- `save_layer(layer, schedule, kv_caches, kv_scales)` inside the forward pass, right after `layer`
  stored this step's K/V: a prefill engine pushes those blocks now, so the transfer hides behind
  the remaining layers' compute.
- `request_finished(req)` once a request's output is final (its logprobs recorded): a prefill
  engine completes the transfer with the first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tandem.engine.request import Request
    from tandem.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class Arrived:
    """A remote prefill is complete: the KV is in the request's blocks; P sampled `first_token`."""

    request_id: str
    first_token: int
    logprobs: list[list[Any]] | None = None  # [[token_id, logprob], ...] of the first token, if asked


@dataclass(slots=True)
class KVUpdates:
    arrived: list[Arrived] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason): compute locally
    released: list[str] = field(default_factory=list)  # held blocks are safe to free now


class KVConnector:
    """Both halves with do-nothing defaults: a connector overrides what its role needs."""

    # ---- scheduler half ------------------------------------------------------------------------
    def num_external_tokens(self, req: Request, num_computed: int) -> int:
        return 0

    def on_allocated(self, req: Request, num_computed: int) -> None:
        return None

    def hold_blocks(self, req: Request) -> bool:
        return False

    # ---- worker half ---------------------------------------------------------------------------
    def poll(self) -> KVUpdates:
        return KVUpdates()

    def save_layer(self, layer: int, schedule: SchedulerOutput, kv_caches: list[torch.Tensor],
                   kv_scales: list[torch.Tensor] | None) -> None:
        return None

    def request_finished(self, req: Request) -> None:
        return None

    @property
    def has_pending(self) -> bool:
        """Transfers in flight or blocks held: the engine must keep polling even with nothing to run."""
        return False
