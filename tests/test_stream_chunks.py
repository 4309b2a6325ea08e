"""Streaming chunk cadence over HTTP, as vLLM does it: every engine step that makes tokens sends a chunk,
even when those tokens' text is still empty (a special token, an incomplete UTF-8 character, text held
back for a stop string). Clients time the first chunk as TTFT and the gaps as ITL: withholding chunks
until text appears made both meaningless (a model whose first tokens print nothing showed a TTFT of the
whole completion). Real router and decode worker (the `served` cluster of test_openai_params)."""

from __future__ import annotations

import pytest
from test_openai_params import PROMPT, served, sse

pytestmark = pytest.mark.slow  # real processes: deselected by -m 'not slow'
__all__ = ["served"]  # the module-scoped cluster fixture, shared by name

SILENT = {"logit_bias": {"0": 100}, "ignore_eos": True, "temperature": 0}  # BOS every step: special, no text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tokens_without_text_still_stream_one_chunk_per_step(served, path):
    chat = path.endswith("chat/completions")
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    events = sse(served["http"], path, {**prompt, **SILENT, "max_tokens": 5, "stream": True,
                                        "stream_options": {"include_usage": True}})
    choices = [e["choices"][0] for e in events if e["choices"]]
    if chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}  # the role announcement
        choices = choices[1:]
    steps = [c for c in choices if c["finish_reason"] is None]
    texts = [c["delta"].get("content") if chat else c["text"] for c in steps]
    assert texts == [""] * 5  # one chunk per token, each with its (empty) text
    assert choices[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 5
