"""Typed request bodies for the OpenAI endpoints (pydantic), and the FastAPI app that serves them as
/openapi.json and /docs.

Every /v1/completions and /v1/chat/completions body is validated against these models first
(`validate_body`): a type or range error is a 400 in the OpenAI error shape naming the field (not
FastAPI's 422), then openai_api.py maps the body onto SamplingParams and refuses what tandem does not
do. The models allow extra fields (clients send vendor extras; the ones tandem does not know are
ignored, as OpenAI and vLLM ignore them), so they describe the API rather than freeze it.

The FastAPI app is only reached for the documentation paths: the generation routes are served by
router_svc/openai_server.py through the ASGI adapter in http_server.py, which costs less per request
than FastAPI's routing and dependency layer (measured: docs/PERFORMANCE.md, "Router overhead").
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router_svc.errors import BadRequest

Stop = Union[str, list[str], None]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="optional: one model per server; a wrong name is a 404")
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0, description="wins over max_tokens")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=64, description="choices, each its own request; seed + i per choice")
    stop: Stop = None
    seed: int | None = Field(None, ge=0)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = Field(None, description="{'include_usage': true}")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None
    response_format: dict[str, Any] | None = Field(None, description="text, json_object or json_schema")
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM: json, regex, choice, grammar")
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = Field(None, description="the stop string that ended it stays in the text")
    skip_special_tokens: bool | None = Field(None, description="false: special tokens' text is kept (default true)")
    use_beam_search: bool | None = Field(None, description="beam search: n is the beam width (at most 16)")
    length_penalty: float | None = Field(None, description="beam search: score = logprob sum / length ** this")
    early_stopping: Union[bool, Literal["never"], None] = Field(
        None, description="beam search: true stops once n hypotheses finished (transformers' meanings)")


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        ..., description="a string, token ids, or a batch of either (one choice per prompt, in order)")
    logprobs: int | None = Field(None, ge=0, le=20, description="top-n logprobs per generated token")
    echo: bool | None = Field(None, description="the prompt before the completion; with logprobs, the prompt's "
                              "logprobs too (None for its first token); max_tokens may then be 0")
    best_of: int | None = Field(None, description="only equal to n")
    suffix: str | None = Field(None, description="refused unless empty")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, description="functions the model may call (tool_calls.py)")
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = Field(
        None, description="'none', 'required' or {'type': 'function', 'function': {'name': ...}}; 'auto' is refused")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call under tool_choice 'required'")
    add_generation_prompt: bool | None = Field(None, description="vLLM: end the prompt with the assistant's turn "
                                               "(default true, false with continue_final_message)")
    continue_final_message: bool | None = Field(None, description="vLLM: generation continues the last message")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM: more variables for the chat "
                                                        "template, e.g. {'enable_thinking': false}")


def validate_body(body: Any, chat: bool) -> None:
    """Raise BadRequest naming the first field that does not fit the typed model."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        # Union members each report a failure ('prompt.str', 'prompt.list[int]'): the field is loc[0].
        raise BadRequest(f"{'.'.join(loc)}: {first['msg']}", param=loc[0] if loc else None) from None


def docs_app() -> Any:
    """A FastAPI app whose routes declare the typed bodies: it serves /openapi.json and /docs."""
    from fastapi import FastAPI

    app = FastAPI(title="tandem", summary="OpenAI-compatible front door of a disaggregated serving engine",
                  description="Field by field: docs/OPENAI_API.md. Errors use OpenAI's error shape.",
                  redoc_url=None)

    @app.post("/v1/completions", summary="Text completion (JSON, or server-sent events with stream: true)")
    def completions(body: CompletionRequest) -> dict:  # pragma: no cover - served by openai_server
        raise NotImplementedError

    @app.post("/v1/chat/completions", summary="Chat completion (JSON, or server-sent events with stream: true)")
    def chat_completions(body: ChatCompletionRequest) -> dict:  # pragma: no cover
        raise NotImplementedError

    @app.get("/v1/models", summary="The served model")
    def models() -> dict:  # pragma: no cover
        raise NotImplementedError

    @app.get("/health", summary="200 while a decode worker is live, 503 otherwise (never needs the API key)")
    def health() -> dict:  # pragma: no cover
        raise NotImplementedError

    return app
