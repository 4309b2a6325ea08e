"""Request: one sequence's state as the engine sees it.

The whole lifecycle is one rule: `num_computed_tokens` catches up to `num_tokens` (+ speculated
tokens). A prompt's prefill, a prefix-cache hit (computed starts > 0), a chunk, a decode step
(one token behind), recomputation after preemption (computed reset to 0) and a decode worker's
remote KV (computed jumps to the prompt length when the KV arrives) are all that rule.
"""

from __future__ import annotations

import array
import enum
import time

import torch

from tandem.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "params", "eos_token_ids", "max_tokens",
                 "arrival_time", "status", "num_computed_tokens", "block_ids", "block_hashes",
                 "num_cached_tokens", "generator", "spec_token_ids", "finish_reason", "stop_reason",
                 "logprobs", "num_preemptions", "priority", "num_registered_blocks", "kv_peer", "grammar",
                 "prompt_logprobs", "beam", "_token_array", "_prompt")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], max_tokens: int, priority: int = 0) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)  # prompt + output, appended in place
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens  # params.max_tokens clipped to the room left in max_model_len
        self.priority = priority
        self.arrival_time = time.monotonic()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chain hashes of the full blocks of token_ids
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1 = not yet scheduled
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.spec_token_ids: list[int] = []  # proposals to verify in the next step
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.num_preemptions = 0
        self.kv_peer: str | None = None  # decode role: the prefill worker its prompt's KV comes from
        self.grammar = None  # structured.GrammarState when params.structured_outputs (set by the engine)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # set by the engine when asked
        self.beam = None  # beam_search.BeamSearch when this is a beam group's root (set by the engine)
        self._token_array: tuple[array.array, list[int]] | None = None  # see token_array()
        self._prompt: list[int] | None = None  # see prompt_token_ids

    def token_array(self) -> array.array:
        """token_ids as an int64 array, kept in step with the list by appending what it lacks (the list
        only grows in place; a new list object means a rebuild). The penalty pass reads every running
        request's tokens each step: converting the lists cost ~1.2 ms at 64 requests x 600 tokens."""
        cached = self._token_array
        if cached is None or cached[1] is not self.token_ids or len(cached[0]) > len(self.token_ids):
            self._token_array = cached = (array.array("q", self.token_ids), self.token_ids)
        elif len(cached[0]) < len(self.token_ids):
            cached[0].extend(self.token_ids[len(cached[0]):])
        return cached[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt, one list made on first use and shared by every output of the request (a slice per
        step cost O(prompt) per running request per step); callers must not modify it."""
        if self._prompt is None:
            self._prompt = self.token_ids[: self.num_prompt_tokens]
        return self._prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def _grammar_complete(self) -> bool:
        self.grammar.sync(self.token_ids, self.num_prompt_tokens)
        return self.grammar.finished

    def append_token(self, token_id: int) -> bool:
        """Add a sampled token; returns True when it ends the request (and sets the finish reason)."""
        self.token_ids.append(token_id)
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif token_id in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif self.grammar is not None and self._grammar_complete():
            self.finish_reason = "stop"
        elif self.num_output_tokens >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None
