"""Outputs the engine hands back: one RequestOutput per request per step (streaming) or at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """The generated continuation of one request so far."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    cumulative_logprob: float | None = None  # beam search: the hypothesis' summed log-probs


@dataclass(slots=True)
class RequestOutput:
    """What `LLM.generate` returns and `LLMEngine.step` streams. `text_delta`/`new_token_ids` hold
    only what this step added, for streaming."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: per prompt token {token_id: logprob}, None for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None

    # vLLM-style shortcuts for the single-completion case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(slots=True)
class BeamSearchSequence:
    """One hypothesis of `LLM.beam_search` (vLLM's names): `tokens` = prompt + generated tokens."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None
    stop_reason: int | None
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's beam_width hypotheses, best first (score = cum_logprob / generated ** length_penalty)."""

    sequences: list[BeamSearchSequence]
