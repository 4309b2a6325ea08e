"""Beam search's selection rule for one prompt, scored as transformers scores it; no KV here (the
engine side, tandem/engine/beam_group.py, runs the hypotheses as sequences in the paged cache).

One step, given each live hypothesis' next-token log-probabilities:

1. Every (hypothesis, token) continuation gets cumulative log-prob = the hypothesis' + the token's;
   the K = max(2, 1 + #eos) * w best are kept, best first. K > w so that w continue even when some
   of the best end here.
2. A continuation ends if its token is an EOS (unless ignore_eos) or it reaches max_tokens. Among
   the w best only, ended ones join the finished list with score = cumulative / generated ** α
   (generated counts the EOS; the prompt does not), which keeps its w best — unless the search can
   no longer improve (below) or, with early_stopping=True, the list was already full.
3. The best w continuations that did not end are the next live hypotheses, best first.
4. The search ends when all K continuations ended, when early_stopping=True and w hypotheses
   finished, or when the best live hypothesis cannot beat the worst finished one any more; that
   bound divides by the current length, or, with early_stopping="never" and α > 0, by max_tokens.

Arithmetic in float32 like transformers', so near-ties break the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.sampling_params import BeamSearchParams

_NEG = -1.0e9  # transformers' "impossible" score


@dataclass(slots=True)
class Continuation:
    """A live hypothesis for the next step: `parent` indexes this step's live hypotheses."""

    parent: int
    token: int
    cum_logprob: float


@dataclass(slots=True)
class Hypothesis:
    """A finished one: its generated tokens (the EOS included), cumulative log-prob and score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"
    stop_reason: int | None


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


class BeamSearch:
    def __init__(self, params: BeamSearchParams, eos_token_ids: set[int], max_tokens: int) -> None:
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.max_tokens = max_tokens  # params.max_tokens clipped to the room left in max_model_len
        self.num_candidates = max(2, 1 + len(self.eos)) * self.width
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.num_generated = 0  # tokens each live hypothesis has generated
        self.improvable = True
        self.done = False

    def _score(self, cum_logprob: float, length: int) -> float:
        return _f32(float(torch.tensor(cum_logprob, dtype=torch.float32) / (length ** self.length_penalty)))

    def step(self, outputs: list[list[int]], cum_logprobs: list[float], logprobs: torch.Tensor) -> list[Continuation]:
        """`outputs[i]`, `cum_logprobs[i]`: live hypothesis i's generated tokens and score;
        `logprobs` [len(outputs), vocab]: its next-token log-probs. Returns the next live hypotheses."""
        vocab = logprobs.shape[-1]
        acc = logprobs.float() + torch.tensor(cum_logprobs, dtype=torch.float32, device=logprobs.device)[:, None]
        values, indices = acc.view(-1).topk(min(self.num_candidates, acc.numel()))
        generated = self.num_generated + 1
        full = len(self.finished) == self.width and self.early_stopping is True
        live: list[Continuation] = []
        ended = []
        all_ended = True
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
            parent, token = divmod(index, vocab)
            eos = token in self.eos
            if not (eos or generated >= self.max_tokens):
                all_ended = False
                if len(live) < self.width:
                    live.append(Continuation(parent, token, value))
            elif rank < self.width and self.improvable and not full:
                ended.append(Hypothesis(outputs[parent] + [token], value, self._score(value, generated),
                                        "stop" if eos else "length", token if eos else None))
        # Stable sort, earlier finished first among equals (transformers merges old before new).
        self.finished = sorted(self.finished + ended, key=lambda h: -h.score)[:self.width]
        self.num_generated = generated
        if len(self.finished) == self.width:
            bound_len = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else generated
            best_live = self._score(live[0].cum_logprob, bound_len) if live else _NEG
            self.improvable = self.improvable and best_live > self.finished[-1].score
        self.done = (all_ended or not live or not self.improvable
                     or (len(self.finished) == self.width and self.early_stopping is True))
        return live
