"""The router service: tandem's front door (gRPC `tandem.v1.Generation` + OpenAI-compatible HTTP),
the worker registry, routing policies and admission control. Start it with `tandem router`.

- server.py     RouterConfig and `serve()`: wires everything onto one asyncio loop
- core.py       a request's lifecycle through the router (admission, dispatch, retry, abort)
- failover.py   a request whose decode worker refused it or was lost: re-routed or migrated
- registry.py   decode/prefill workers: registration, heartbeats, static workers, expiry
- routing.py    the built-in routing policies (round_robin, least_loaded, prefix_affinity)
- links.py      one ZMQ DEALER per worker (asyncio), the registration ROUTER socket
- prompts.py    model name check, tokenization, chat template
- http_server.py   HTTP/1.1 on uvicorn (httptools): an ASGI adapter with client deadlines and limits
- openai_server.py / openai_api.py / openai_responses.py / openai_models.py   the OpenAI routes,
                request shapes, response shapes, typed (pydantic) request models (/openapi.json, /docs)
- structured_request.py / beam_request.py   response_format & co., use_beam_search: body -> params
- tool_calls.py / tool_parsers.py   tools and tool_choice (a grammar per call; "auto": --tool-call-parser)
- reasoning.py / chat_deltas.py   --reasoning-parser; a chat choice's text parsed on its way out
- tokenize_api.py   vLLM's /tokenize and /detokenize
- fanout.py     `n` and batched prompts: one request in flight per choice
- grpc_api.py   the gRPC servicer, health and reflection
- errors.py / metrics.py
"""
