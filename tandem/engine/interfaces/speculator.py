"""The speculator interface (`--speculator NAME`): what the engine calls to get speculated tokens.

Contract with the engine (tandem/engine/llm_engine.py):
1. Constructed once at engine start with a `SpeculatorContext` (resolved by name once, never per step).
2. Each step, while speculation is on, `propose(requests)` gets the running requests that are
   decoding (every token but the last sampled one is computed) and returns up to
   `num_to_propose(req)` tokens per request id. A request missing from the answer is not speculated.
3. A speculator that *sampled* its proposal (temperature > 0) leaves the distributions it sampled
   from in `self.draft_probs[request_id]` ([k, V]) for exact rejection sampling; no entry means a
   deterministic proposal (a point mass).
4. `on_request_finished(request_id)` drops per-request state. There is no acceptance callback: the
   next `propose` sees the accepted tokens in `req.token_ids`, which is the only truth to sync to.
5. A speculator with `wants_hidden_states = True` gets, after every forward pass, the target's final
   hidden states of each token the pass computed (`observe_hidden_states`), speculated ones included:
   rows past `req.num_tokens - 2` once the step is applied belong to rejected tokens. Positions it never
   saw (a prefix-cache hit, a prompt prefilled elsewhere) it can recompute with `ctx.target.hidden_states`.
6. `catch_up(requests)` after a step that computed prompts (see its docstring); optional.

Implementations: plugins/speculators.py (`ngram`, `draft_model`, `eagle`) or a third-party plugin.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from tandem.config import EngineConfig
from tandem.engine.request import Request
from tandem.models.config import ModelConfig

if TYPE_CHECKING:
    from tandem.engine.model_runner import ModelRunner


@dataclass(slots=True)
class SpeculatorContext:
    """What a speculator may need to build itself."""

    config: EngineConfig  # num_speculative_tokens, draft_model, spec_max_batch, block_size, seed...
    model_config: ModelConfig  # the target model's
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    # The target's runner: its model (embedding and lm_head, shared, never copied) and `hidden_states`.
    target: "ModelRunner | None" = None


class Speculator(ABC):
    """Proposes up to k tokens per decoding request, batched over the running requests."""

    wants_hidden_states = False  # True: the engine calls observe_hidden_states after each forward pass

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.ctx = ctx
        self.k = ctx.config.num_speculative_tokens
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.step_limit: int | None = None  # set by the engine around one proposal (spec_decode.attach_proposals)

    def num_to_propose(self, req: Request) -> int:
        """k (or the engine's limit for this step, if lower), less where max_tokens is near: a verifying step
        emits up to proposals + 1 tokens."""
        k = self.k if self.step_limit is None else min(self.k, self.step_limit)
        return max(0, min(k, req.max_tokens - req.num_output_tokens - 1))

    @abstractmethod
    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        """Speculated continuations of each request's `token_ids` (may be shorter than k, or absent)."""

    def stats(self) -> dict[str, Any]:
        """Counters of this speculator's own, merged into the engine's speculator stats."""
        return {}

    def warm_modules(self) -> list[torch.nn.Module]:
        """Its own model's layers (a draft model's, an EAGLE head's), which the engine's start-up warm-up
        runs at every prompt size as it runs the target's (tandem/engine/warm_up.py); none by default."""
        return []

    def on_request_finished(self, request_id: str) -> None:  # noqa: B027 (optional hook)
        """The request finished or was aborted: free anything held for it."""

    def catch_up(self, requests: Sequence[Request]) -> None:  # noqa: B027 (optional hook)
        """Requests whose prompt this step computed (they decode next), while speculation is on: work on
        the prompt that the first `propose` would do otherwise (EAGLE's head over it) can run now, in the
        prefill's step, as vLLM's drafter does — not in the first decode step. Nothing by default."""

    def observe_hidden_states(self, hidden: dict[str, tuple[int, torch.Tensor]]) -> None:  # noqa: B027
        """request id -> (position of the first row, the target's final hidden states [n, H]) of the
        tokens one forward pass computed; called only if `wants_hidden_states`."""
