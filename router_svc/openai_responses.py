"""OpenAI response shapes: Chunks -> completion / chat.completion objects, their streaming chunks,
usage, and logprobs in OpenAI's shapes (generated tokens, and the prompt's under echo). Pure
functions, no I/O; the request side is router_svc/openai_api.py.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from router_svc.chat_deltas import whole_message
from router_svc.core import Chunk
from router_svc.prompts import ServedModel
from router_svc.reasoning import Reasoning
from router_svc.tool_calls import ToolPlan


@dataclass(slots=True)
class Totals:
    """Accumulates a request's chunks (non-streaming answer, and usage for streaming)."""

    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, chunk: Chunk, keep_output: bool = True) -> None:
        """`keep_output` False: echo with max_tokens 0 (the one generated token is not the client's)."""
        if keep_output:
            self.text += chunk.text
            self.completion_tokens += len(chunk.token_ids)
        self.prompt_tokens, self.cached_tokens = chunk.num_prompt_tokens, chunk.num_cached_tokens
        if chunk.finished:
            self.finish_reason, self.stop_reason = chunk.finish_reason if keep_output else "length", chunk.stop_reason


def usage(totals: list[Totals], n: int) -> dict:
    """A request's usage over its choices: each prompt counted once (not n times), every choice's tokens."""
    firsts = totals[::n]
    prompt, cached = sum(t.prompt_tokens for t in firsts), sum(t.cached_tokens for t in firsts)
    completion = sum(t.completion_tokens for t in totals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def response_id(rid: str, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + rid


def _envelope(rid: str, chat: bool, model: str, stream: bool) -> dict:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {"id": response_id(rid, chat), "object": kind, "created": int(time.time()), "model": model}


def final_response(rid: str, chat: bool, model: str, totals: list[Totals], logprobs: list[Any], n: int,
                   tools: ToolPlan | None = None, reasoning: Reasoning | None = None) -> dict:
    """`tools` / `reasoning`: each choice's text is read for tool calls / split from its reasoning
    (router_svc/chat_deltas.py)."""
    choices = []
    for index, (t, lp) in enumerate(zip(totals, logprobs)):
        choice: dict[str, Any] = {"index": index, "logprobs": lp, "finish_reason": t.finish_reason,
                                  "stop_reason": t.stop_reason}
        if chat and (tools is not None or reasoning is not None):
            choice["message"], choice["finish_reason"] = whole_message(t.text, t.finish_reason, reasoning, tools)
        elif chat:
            choice["message"] = {"role": "assistant", "content": t.text}
        else:
            choice["text"] = t.text
        choices.append(choice)
    return {**_envelope(rid, chat, model, False), "choices": choices, "usage": usage(totals, n)}


def stream_chunk(rid: str, chat: bool, model: str, text: str | None, finish_reason: str | None,
                 logprobs: Any = None, first: bool = False, include_usage: bool = False, index: int = 0,
                 delta: dict[str, Any] | None = None) -> dict:
    """`delta` (chat): the delta object to send in place of one made of `text` (tool calls)."""
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    if chat and delta is not None:
        choice["delta"] = delta
    elif chat:
        delta = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    out = {**_envelope(rid, chat, model, True), "choices": [choice]}
    if include_usage:
        out["usage"] = None  # OpenAI sends usage: null on every chunk but the last when asked for usage
    return out


def usage_chunk(rid: str, chat: bool, model: str, totals: list[Totals], n: int) -> dict:
    return {**_envelope(rid, chat, model, True), "choices": [], "usage": usage(totals, n)}


def format_logprobs(chunk: Chunk, model: ServedModel, chat: bool, offset: int = 0) -> Any:
    """D's per-token logprobs ({token_id: logprob} per generated token, the chosen one included) in
    OpenAI's shape; None when D sent none. `offset`: where this chunk's text starts in the completion
    (completions' `text_offset` counts characters from the completion's start)."""
    if not chunk.logprobs:
        return None
    tok = model.tokenizer
    rows = []
    for token_id, entry in zip(chunk.token_ids, chunk.logprobs):
        pairs = {int(k): float(v) for k, v in (entry.items() if isinstance(entry, dict) else entry)}
        rows.append((token_id, pairs.get(token_id, float("nan")),
                     sorted(pairs.items(), key=lambda kv: -kv[1])))
    text = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    if chat:
        return {"content": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                             "top_logprobs": [{"token": text(i), "logprob": v, "bytes": list(text(i).encode())}
                                              for i, v in top]} for t, lp, top in rows]}
    tokens = [text(t) for t, _, _ in rows]
    offsets = [offset + sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [{text(i): v for i, v in top} for _, _, top in rows], "text_offset": offsets}


def echo_logprobs(ids: list[int], entries: list[Any] | None, model: ServedModel) -> dict:
    """The prompt's part of a completion's logprobs under echo, in the completions shape: D's entries
    ([[token_id, logprob], ...] per prompt token, None for the first, which has no prefix)."""
    text = lambda t: model.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    tokens = [text(t) for t in ids]
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for token_id, entry in zip(ids, entries or [None] * len(ids)):
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        pairs = {int(k): float(v) for k, v in entry}
        lps.append(pairs.get(token_id, float("nan")))
        tops.append({text(i): v for i, v in sorted(pairs.items(), key=lambda kv: -kv[1])})
    offsets = [0, *itertools.accumulate(len(s) for s in tokens)][:len(tokens)]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def text_length(lp: dict) -> int:
    """The characters of a completion's logprobs chunk (its tokens' text): the next chunk's text_offset."""
    return sum(len(t) for t in lp["tokens"]) if "tokens" in lp else 0


def merge_logprobs(parts: list[Any], chat: bool) -> Any:
    """One choice's logprobs chunks, in order, as one logprobs object (a non-streamed response)."""
    if not parts:
        return None
    if chat:
        return {"content": [row for p in parts for row in p["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [v for p in parts for v in p[key]] for key in keys}
