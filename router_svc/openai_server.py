"""The HTTP routes: OpenAI-compatible `/v1/completions`, `/v1/chat/completions` (JSON or SSE with
`stream: true`), `/v1/models`, vLLM's `/tokenize` and `/detokenize`, plus `/health` and `/metrics`.

A generation request: parse (openai_api) -> `Router.submit` once per choice (fanout.py: `n` and
batched prompts) -> collect or stream their Chunks -> `close()` in `finally:`, which aborts the
requests on D if the client went away (the HTTP server cancels the handler when the socket closes)
or anything failed. Errors before the first
byte are OpenAI error objects with the matching status (400/404/429 + Retry-After/503); an error
after streaming began is sent as a final SSE `data: {"error": ...}` event.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router_svc import metrics
from router_svc.admin import Admin
from router_svc.auth import key_matches
from router_svc.chat_deltas import ChoiceDeltas
from router_svc.core import Chunk, Router
from router_svc.errors import BadRequest, NotFound, Overloaded, RouterError
from router_svc.fanout import Choices, choice_ids, submit_all
from router_svc.http_messages import Request, Response
from router_svc.openai_api import ParsedRequest, parse_chat, parse_completion
from router_svc.openai_responses import (
    Totals,
    echo_logprobs,
    final_response,
    format_logprobs,
    merge_logprobs,
    stream_chunk,
    text_length,
    usage_chunk,
)
from router_svc.prompts import ServedModel
from router_svc.registry import Registry
from router_svc.tokenize_api import detokenize, tokenize
from tandem.observability.logging import bind_request


class OpenAIApp:
    def __init__(self, router: Router, registry: Registry, model: ServedModel, api_key: str | None = None,
                 admin: Admin | None = None, protect_metrics: bool = False) -> None:
        self.router = router
        self.registry = registry
        self.admin = admin  # /admin/* (router_svc/admin.py); None: off
        # with an API key, these paths need it (/health never does: probes)
        self.guarded = ("/v1", "/admin", "/tokenize", "/detokenize", *(("/metrics",) if protect_metrics else ()))
        self.api_key = api_key  # /v1/* need `Authorization: Bearer <key>`; /health and /metrics stay open
        self.model = model

    async def __call__(self, request: Request, response: Response) -> None:
        route = (request.method, request.path.rstrip("/") or "/")
        if self.api_key and request.path.startswith(self.guarded) and not key_matches(
                request.headers.get("authorization", ""), self.api_key):
            await response.json(401, {"error": {"message": "missing or wrong API key: send 'Authorization: Bearer "
                                                           "<key>'", "type": "invalid_request_error",
                                                "param": None, "code": "invalid_api_key"}})
            return
        if route == ("POST", "/v1/completions"):
            await self.generate(request, response, chat=False)
        elif route == ("POST", "/v1/chat/completions"):
            await self.generate(request, response, chat=True)
        elif route == ("GET", "/v1/models"):
            await response.json(200, {"object": "list", "data": [self._model_card()]})
        elif request.method == "GET" and request.path.startswith("/v1/models/"):
            name = request.path[len("/v1/models/"):]
            try:
                self.model.check_model(name)
            except RouterError as exc:
                await response.json(exc.http_status, exc.openai_body())
                return
            await response.json(200, self._model_card())
        elif route in (("POST", "/tokenize"), ("POST", "/detokenize")):
            await self.tokens(request, response, route[1])
        elif request.path.startswith("/admin/"):
            await self.admin_route(request, response)
        elif route == ("GET", "/health"):
            await self.health(response)
        elif route == ("GET", "/metrics"):
            await response.send(200, generate_latest(), CONTENT_TYPE_LATEST)
        elif route[1] in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                          "/detokenize"):
            await _fail(response, RouterError(f"method {request.method} is not allowed on {request.path}"), 405)
        else:
            await _fail(response, RouterError(f"no route {request.method} {request.path}"), 404)

    async def admin_route(self, request: Request, response: Response) -> None:
        parts = request.path.strip("/").split("/")  # admin, workers[, id, action]
        try:
            if self.admin is None:
                raise NotFound("the admin API is off: start the router with --enable-admin")
            if request.method == "GET" and parts == ["admin", "workers"]:
                await response.json(200, self.admin.workers())
            elif request.method == "POST" and len(parts) == 4 and parts[:2] == ["admin", "workers"]:
                if parts[3] == "drain":
                    await response.json(202, self.admin.drain(parts[2]))
                elif parts[3] == "role":
                    try:
                        body = request.json()
                    except (ValueError, UnicodeDecodeError):
                        raise BadRequest("the request body is not valid JSON") from None
                    await response.json(202, self.admin.set_role(parts[2], body))
                else:
                    raise NotFound(f"no route {request.method} {request.path}")
            else:
                raise NotFound(f"no route {request.method} {request.path}")
        except RouterError as exc:
            await _fail(response, exc)

    async def tokens(self, request: Request, response: Response, path: str) -> None:
        """vLLM's /tokenize and /detokenize (router_svc/tokenize_api.py)."""
        try:
            try:
                body = request.json()
            except (ValueError, UnicodeDecodeError):
                raise BadRequest("the request body is not valid JSON") from None
            await response.json(200, (tokenize if path == "/tokenize" else detokenize)(body, self.model))
        except RouterError as exc:
            await _fail(response, exc)

    def _model_card(self) -> dict:
        return {"id": self.model.name, "object": "model", "created": self.model.created, "owned_by": "tandem",
                "root": self.model.path, "max_model_len": self.model.max_model_len}

    async def health(self, response: Response) -> None:
        live = {role: len(self.registry.live(role)) for role in ("decode", "prefill")}
        ok = live["decode"] > 0 and not self.router.draining
        status = "draining" if self.router.draining else "ok" if ok else "no decode workers"
        await response.json(200 if ok else 503, {
            "status": status, "model": self.model.name, "live_workers": live,
            **self.router.describe(), "workers": self.registry.describe()})

    async def generate(self, request: Request, response: Response, chat: bool) -> None:
        api = "chat" if chat else "completions"
        choices: Choices | None = None
        parsed: ParsedRequest | None = None
        ended_by: BaseException | None = None
        # the id is fixed before parsing so every line of this request carries it
        rid = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
        bind_request(rid)  # this handler runs in its own task: the binding ends with it
        response.extra_headers["X-Request-Id"] = rid
        try:
            try:
                body = request.json()
            except (ValueError, UnicodeDecodeError):
                raise BadRequest("the request body is not valid JSON") from None
            parsed = (parse_chat if chat else parse_completion)(body, self.model)
            choices = Choices(submit_all(self.router, parsed.prompts, parsed.params, parsed.n, rid, parsed.beam))
            for i, sub_id in enumerate(choice_ids(rid, len(choices.streams))):
                metrics.request_admitted(sub_id, parsed.prompts[i if parsed.beam else i // parsed.n], self.model)
            if parsed.beam is not None:
                await self._collect_beams(rid, choices, response, parsed)
            elif parsed.stream:
                await self._stream(rid, choices, response, parsed)
            else:
                await self._collect(rid, choices, response, parsed)
        except RouterError as exc:
            if parsed is not None and parsed.tools is not None and parsed.tools.structured is not None \
                    and exc.param == "structured_outputs":
                exc = BadRequest(f"tools: a function's parameters cannot be used as a grammar ({exc})", param="tools")
            ended_by = exc
            if not response.started:
                await _fail(response, exc)
            else:
                await _sse(response, exc.openai_body())
                await response.end_stream()
        except BaseException as exc:  # cancelled (client gone) or a bug: recorded, then re-raised
            ended_by = exc
            raise
        finally:
            if choices is None:
                metrics.request_ended(api, ended_by, None, rid)
            else:
                choices.close()
                for sub_id, s in zip(choice_ids(rid, len(choices.streams)), choices.streams):
                    metrics.request_ended(api, ended_by, s, sub_id)

    async def _collect(self, rid: str, choices: Choices, response: Response, parsed: ParsedRequest) -> None:
        count, chat = len(choices.streams), parsed.chat
        totals = [Totals() for _ in range(count)]
        logprobs: list[list[Any]] = [[] for _ in range(count)]
        offsets, echoed_choices = [0] * count, set[int]()
        async for i, chunk in choices:
            echoed = self._echo(parsed, i, chunk, echoed_choices)
            if echoed is not None:
                totals[i].text, echo_lp = echoed
                offsets[i] = len(totals[i].text)
                if echo_lp is not None:
                    logprobs[i].append(echo_lp)
            totals[i].add(chunk, keep_output=not parsed.drop_output)
            lp = None if parsed.drop_output else format_logprobs(chunk, self.model, chat, offsets[i])
            if lp is not None:
                logprobs[i].append(lp)
                offsets[i] += text_length(lp)
        await response.json(200, final_response(rid, chat, self.model.name, totals,
                                                [merge_logprobs(parts, chat) for parts in logprobs], parsed.n,
                                                parsed.tools, parsed.reasoning))

    async def _collect_beams(self, rid: str, choices: Choices, response: Response, parsed: ParsedRequest) -> None:
        """use_beam_search: each prompt's one answer carries its n hypotheses, best first: its n choices."""
        n = parsed.n
        totals = [Totals() for _ in range(len(parsed.prompts) * n)]
        async for i, chunk in choices:
            for j, beam in enumerate((chunk.beams or [])[:n]):
                t = totals[i * n + j]
                t.text, t.completion_tokens = beam["text"], len(beam["token_ids"])
                t.finish_reason, t.stop_reason = beam["finish_reason"], beam.get("stop_reason")
            for t in totals[i * n:(i + 1) * n]:
                t.prompt_tokens, t.cached_tokens = chunk.num_prompt_tokens, chunk.num_cached_tokens
        await response.json(200, final_response(rid, parsed.chat, self.model.name, totals, [None] * len(totals), n,
                                                reasoning=parsed.reasoning))

    def _echo(self, parsed: ParsedRequest, i: int, chunk: Chunk, done: set[int]) -> tuple[str, Any] | None:
        """On a choice's first chunk under echo: its prompt's text, and the prompt's logprobs if asked."""
        if parsed.echo_texts is None or i in done:
            return None
        done.add(i)
        ids = parsed.prompts[i // parsed.n]
        lp = None if parsed.params[i].prompt_logprobs is None else echo_logprobs(ids, chunk.prompt_logprobs, self.model)
        return parsed.echo_texts[i], lp

    async def _stream(self, rid: str, choices: Choices, response: Response, parsed: ParsedRequest) -> None:
        name, count, chat, include_usage = self.model.name, len(choices.streams), parsed.chat, parsed.include_usage
        totals, offsets, echoed_choices = [Totals() for _ in range(count)], [0] * count, set[int]()
        parsing = parsed.tools is not None or parsed.reasoning is not None  # the text is read on its way out
        parsers = [ChoiceDeltas.make(parsed.reasoning, parsed.tools) for _ in range(count)] if parsing else None
        await response.start_stream()
        if chat:  # OpenAI's first chat chunk of each choice announces the role
            for i in range(count):
                await _sse(response, stream_chunk(rid, True, name, "", None, first=True, include_usage=include_usage,
                                                  index=i))
        async for i, chunk in choices:
            echoed = self._echo(parsed, i, chunk, echoed_choices)
            if echoed is not None:  # the prompt goes out first, as its own chunk
                offsets[i] = len(echoed[0])
                await _sse(response, stream_chunk(rid, chat, name, echoed[0], None, echoed[1],
                                                  include_usage=include_usage, index=i))
            totals[i].add(chunk, keep_output=not parsed.drop_output)
            if parsed.drop_output:
                chunk = replace(chunk, text="", logprobs=None, finish_reason="length" if chunk.finished else None)
            # completions' text_offset: characters of the tokens before, from the completion's start
            lp = format_logprobs(chunk, self.model, chat, offsets[i])
            if lp is not None:
                offsets[i] += text_length(lp)
            if parsers is not None:  # reasoning / tool calls: their deltas in place of the text's
                await self._stream_parsed(rid, response, parsed, parsers[i], chunk, lp, i)
                continue
            # A chunk per step that made tokens, even when their text is still empty (held back for a stop
            # string, an incomplete UTF-8 character, a special token): as vLLM does, so a client's first
            # chunk marks the first token (TTFT) and every step shows as an inter-token gap.
            if chunk.text or lp is not None or (chunk.token_ids and not parsed.drop_output):
                await _sse(response, stream_chunk(rid, chat, name, chunk.text, None, lp, include_usage=include_usage,
                                                  index=i))
            if chunk.finished:
                await _sse(response, stream_chunk(rid, chat, name, None, chunk.finish_reason,
                                                  include_usage=include_usage, index=i))
        if include_usage:
            await _sse(response, usage_chunk(rid, chat, name, totals, parsed.n))
        await response.write(b"data: [DONE]\n\n")
        await response.end_stream()


    async def _stream_parsed(self, rid: str, response: Response, parsed: ParsedRequest, parser: ChoiceDeltas,
                             chunk: Chunk, lp: Any, index: int) -> None:
        """One chunk of a choice whose text is parsed (router_svc/chat_deltas.py): a chunk per step (an
        empty delta while nothing can be said yet), then the one that finishes it."""
        name, usage_on = self.model.name, parsed.include_usage
        deltas, reason = parser.feed(chunk.text, chunk.finished, chunk.finish_reason)
        for delta in deltas or ([{}] if chunk.token_ids or lp is not None else []):
            await _sse(response, stream_chunk(rid, True, name, None, None, lp, include_usage=usage_on, index=index,
                                              delta=delta))
            lp = None
        if chunk.finished:
            await _sse(response, stream_chunk(rid, True, name, None, reason, include_usage=usage_on, index=index,
                                              delta={}))


async def _sse(response: Response, obj: Any) -> None:
    await response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


async def _fail(response: Response, exc: RouterError, status: int | None = None) -> None:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else None
    await response.json(status or exc.http_status, exc.openai_body(), headers)
