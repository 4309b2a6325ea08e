"""gRPC front end: `tandem.v1.Generation/Generate` (server streaming), the standard
`grpc.health.v1.Health` service and server reflection, on a grpc.aio server sharing the router's loop.

A call: GenerateRequest -> token ids + SamplingParams (unset optional fields keep SamplingParams'
defaults) -> `Router.submit` -> one GenerateResponse per Chunk; the last carries finish reason,
stop reason and usage. A cancelled call raises CancelledError inside the handler; `finally:` closes
the Stream, which sends `abort` to D. Errors map to status codes: INVALID_ARGUMENT (message names
the parameter), NOT_FOUND (model), RESOURCE_EXHAUSTED (+ `retry-after` trailing metadata),
UNAVAILABLE (no decode worker / worker lost).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from router_svc import metrics
from router_svc.auth import key_matches
from router_svc.core import Chunk, Router
from router_svc.errors import BadRequest, Overloaded, RouterError
from router_svc.openai_api import SAMPLING_NAMES
from router_svc.prompts import ServedModel
from tandem.observability.logging import bind_request
from tandem.protocol import generation_pb2 as pb
from tandem.protocol import generation_pb2_grpc as pb_grpc
from tandem.sampling_params import SamplingParams

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_OPTIONAL_SCALARS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "logprobs",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs",
                     "include_stop_str_in_output", "skip_special_tokens")


def sampling_from_proto(msg: pb.SamplingParams, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """`defaults`: the checkpoint's generation_config.json values, for the fields the message leaves unset."""
    kw: dict[str, Any] = {**(defaults or {}),
                          **{name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)}}
    kw["stop"] = list(msg.stop)
    kw["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        kw["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_outputs"):
        try:
            kw["structured_outputs"] = json.loads(msg.structured_outputs)
        except (ValueError, RecursionError):
            raise BadRequest("structured_outputs must be JSON text, e.g. '{\"regex\": \"[0-9]+\"}'",
                             param="structured_outputs") from None
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as exc:
        raise BadRequest.from_exception(exc, SAMPLING_NAMES) from None


def prompt_from_proto(request: pb.GenerateRequest, model: ServedModel) -> list[int]:
    which = request.WhichOneof("prompt")
    if which == "text":
        return model.encode_text(request.text, param="text")
    if which == "token_ids":
        return model.check_ids(list(request.token_ids.ids), param="token_ids")
    if which == "chat":
        chat = request.chat
        kwargs = None
        if chat.HasField("chat_template_kwargs"):
            try:
                kwargs = json.loads(chat.chat_template_kwargs)
            except (ValueError, RecursionError):
                kwargs = None
            if not isinstance(kwargs, dict):
                raise BadRequest("chat_template_kwargs must be a JSON object's text, e.g. '{\"enable_thinking\": "
                                 "false}'", param="chat_template_kwargs")
        continuing = chat.HasField("continue_final_message") and chat.continue_final_message
        adding = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not continuing
        return model.encode_chat([{"role": m.role, "content": m.content} for m in chat.messages], param="chat",
                                 add_generation_prompt=adding, continue_final_message=continuing,
                                 template_kwargs=kwargs)
    raise BadRequest("the request has no prompt: set one of text, token_ids, chat", param="prompt")


def _token_logprob(token_id: int, entry: Any) -> pb.TokenLogprob:
    """One token's entry ({id: logprob} or [[id, logprob], ...]: the chosen token and the top n)."""
    pairs = {int(k): float(v) for k, v in (entry.items() if isinstance(entry, dict) else entry)}
    return pb.TokenLogprob(token_id=token_id, logprob=pairs.get(token_id, float("nan")),
                           top=[pb.TopLogprob(token_id=i, logprob=v)
                                for i, v in sorted(pairs.items(), key=lambda kv: -kv[1])])


def response_from_chunk(rid: str, chunk: Chunk, totals: list[int], prompt_ids: Sequence[int] = ()
                        ) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text, finished=chunk.finished)
    if chunk.logprobs:
        resp.logprobs.extend(_token_logprob(t, entry) for t, entry in zip(chunk.token_ids, chunk.logprobs))
    if chunk.prompt_logprobs:  # the first entry (the first prompt token) is None: nothing predicts it
        resp.prompt_logprobs.extend(_token_logprob(t, entry) for t, entry in zip(prompt_ids, chunk.prompt_logprobs)
                                    if entry is not None)
    if chunk.finished:
        resp.finish_reason = chunk.finish_reason or ""
        resp.usage.prompt_tokens = chunk.num_prompt_tokens
        resp.usage.completion_tokens = totals[0]
        resp.usage.cached_tokens = chunk.num_cached_tokens
        if isinstance(chunk.stop_reason, str):
            resp.stop_string = chunk.stop_reason
        elif isinstance(chunk.stop_reason, int):
            resp.stop_token_id = chunk.stop_reason
    return resp


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, router: Router, model: ServedModel, api_key: str | None = None) -> None:
        self.router = router
        self.model = model
        self.api_key = api_key  # Generate needs `authorization: Bearer <key>` metadata; health stays open

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        stream = None
        ended_by: BaseException | None = None
        rid = request.request_id or f"req-{uuid.uuid4().hex}"  # bound for all lines
        bind_request(rid)  # grpc.aio runs each RPC in its own task: the binding ends with it
        if self.api_key:
            metadata = dict(context.invocation_metadata() or ())
            if not key_matches(str(metadata.get("authorization", "")), self.api_key):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "missing or wrong API key: send metadata 'authorization: Bearer <key>'")
        try:
            self.model.check_model(request.model)
            ids = prompt_from_proto(request, self.model)
            params = sampling_from_proto(request.sampling, self.model.sampling_defaults)
            stream = self.router.submit(ids, params, rid)
            metrics.request_admitted(rid, ids, self.model)
            completion_tokens = [0]
            async for chunk in stream:
                completion_tokens[0] += len(chunk.token_ids)
                yield response_from_chunk(stream.request_id, chunk, completion_tokens, ids)
        except RouterError as exc:
            ended_by = exc
            if isinstance(exc, Overloaded):
                context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
            await context.abort(exc.grpc_code, exc.message)
        except BaseException as exc:  # cancelled by the client (or a bug): recorded, re-raised
            ended_by = exc
            raise
        finally:
            if stream is not None:
                stream.close()
            metrics.request_ended("grpc", ended_by, stream, rid)


# Limits: what one client can make the router hold. A request message is a prompt (text or token
# ids): MAX_MESSAGE_BYTES is far above any prompt a model takes, far below what would hurt memory.
# Per connection, at most MAX_STREAMS_PER_CONNECTION concurrent RPCs; a silent peer (half-open TCP)
# fails the server's keepalive ping and is closed; an idle connection is closed after IDLE_CLOSE_MS.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_STREAMS_PER_CONNECTION = 128
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_connection_idle_ms", 300_000),
]


async def start_grpc(router: Router, model: ServedModel, host: str, port: int, api_key: str | None = None,
                     tls: tuple[bytes, bytes] | None = None,
                     max_rpcs: int | None = None) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """Build, bind and start the gRPC server; returns it, its port and the health servicer. `tls`:
    (private key PEM, certificate chain PEM) for a TLS port; None for plaintext. `max_rpcs` bounds the
    RPCs in progress (past it: RESOURCE_EXHAUSTED), so memory stays bounded however many clients come."""
    server = grpc.aio.server(options=SERVER_OPTIONS, maximum_concurrent_rpcs=max_rpcs)
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(router, model, api_key), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([tls]))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    return server, bound, health


async def set_health(health: HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        await health.set(name, status)
