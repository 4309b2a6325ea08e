"""OutputBuilder: what a request streams back — incremental detokenization, stop strings (a hit
finishes the request in the same step, its text cut before the string, or after it with
include_stop_str_in_output), per-token logprobs, and the RequestOutput of each step.

A request is `track`ed when it is queued by this engine's own front door (a prefill worker's
requests are not: nobody reads their text); `build` makes its output after a step; a finished
request's detokenizer is dropped.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.engine.request import Request
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputBuilder:
    def __init__(self, tokenizer: Tokenizer, finish: Callable[[Request, str], None]) -> None:
        """`finish(req, reason)` ends a request early (the scheduler's), for a stop string."""
        self.tokenizer = tokenizer
        self.finish = finish
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.text: dict[str, str] = {}  # the text streamed so far, stop strings cut

    def track(self, req: Request) -> None:
        self.detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                            req.params.skip_special_tokens)
        self.text[req.request_id] = ""

    @staticmethod
    def record_logprobs(req: Request, logits: torch.Tensor, new_ids: list[int]) -> None:
        from tandem.engine.sampler import top_logprobs

        for row, tok in zip(logits[-len(new_ids):], new_ids):
            req.logprobs.append(top_logprobs(row, [tok], req.params.logprobs))

    def build(self, req: Request, new_ids: list[int]) -> RequestOutput:
        rid = req.request_id
        detok = self.detok.get(rid)
        delta = ""
        if detok is not None:
            keep_stop = req.params.include_stop_str_in_output
            text_ids = [t for t in new_ids if keep_stop or not (req.finished and t == req.stop_reason)]
            delta = detok.add(text_ids, final=req.finished)
            delta = self._apply_stop_strings(req, delta)
        text = self.text.get(rid, "")
        if req.finished:
            self.detok.pop(rid, None)
            self.text.pop(rid, None)
        # A copy: an output made before this step's compute (a remote first token) must not see the
        # entries the compute appends.
        logprobs = list(req.logprobs) if req.logprobs is not None else None
        completion = CompletionOutput(text, req.output_token_ids, req.finish_reason, req.stop_reason, logprobs)
        return RequestOutput(rid, req.prompt_token_ids, [completion], req.finished,
                             max(req.num_cached_tokens, 0), delta, new_ids, req.prompt_logprobs)

    def _apply_stop_strings(self, req: Request, delta: str) -> str:
        rid = req.request_id
        before = self.text.get(rid, "")
        text = before + delta
        stops = req.params.stop
        if stops and not req.finished:
            lookback = max(len(before) - max(len(s) for s in stops) + 1, 0)
            hits = [(text.find(s, lookback), s) for s in stops if text.find(s, lookback) >= 0]
            if hits:
                pos, s = min(hits)
                text = text[:pos + len(s)] if req.params.include_stop_str_in_output else text[:pos]
                req.stop_reason = s
                self.finish(req, "stop")
        self.text[rid] = text
        return text[len(before):]
