"""`tandem router`: the front door — OpenAI-compatible HTTP + gRPC, routing requests to decode
workers (which pull prompts' KV from prefill workers). Workers register themselves with
`--listen`, or are given statically with `--decode` / `--prefill`."""

from __future__ import annotations

import argparse
import os

from router_svc.reasoning import PARSERS as REASONING_PARSERS
from router_svc.tool_parsers import PARSERS
from tandem.cli.engine_args import add_model_arg, resolve_model
from tandem.cli.keys import add_link_args, apply_link_args
from tandem.observability.cli import add_observability_args, setup_logging

_POLICY_HELP = "round_robin | least_loaded | prefix_affinity, or a plugin's (see `tandem plugins`)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="serve the OpenAI HTTP and gRPC APIs, routing to prefill/decode workers",
                       description="Run the router. It loads only the tokenizer and chat template of --model "
                                   "(the workers hold the weights) and prints its endpoints when ready.")
    add_model_arg(p)
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model directory's name)")
    p.add_argument("--host", default="0.0.0.0", help="interface for the HTTP and gRPC servers")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port (0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--listen", default="tcp://0.0.0.0:5557",
                   help="ZMQ address workers register and heartbeat to (tcp://host:0 = any free port)")
    p.add_argument("--decode", action="append", default=[], metavar="ADDR",
                   help="static decode worker control address (repeatable), e.g. tcp://10.0.0.2:6000")
    p.add_argument("--prefill", action="append", default=[], metavar="ADDR",
                   help="static prefill worker control address (repeatable)")
    p.add_argument("--decode-policy", default="prefix_affinity", help=_POLICY_HELP)
    p.add_argument("--prefill-policy", default="prefix_affinity", help=_POLICY_HELP)
    p.add_argument("--max-inflight", type=int, default=256,
                   help="admission limit: requests in flight beyond this get HTTP 429 / RESOURCE_EXHAUSTED")
    p.add_argument("--local-prefill-if-busy", type=int, default=0, metavar="TOKENS",
                   help="conditional disaggregation: a prompt of at most TOKENS tokens whose prefill worker "
                        "already has a prompt in flight is prefilled by its decode worker instead of queueing "
                        "at P (better TTFT under bursts, at the cost of that prefill in D's streams' ITL); "
                        "longer prompts always go to P. Default 0: every prompt goes to P")
    p.add_argument("--heartbeat-misses", type=float, default=3.0,
                   help="a registered worker silent for this many of its heartbeat intervals is removed")
    p.add_argument("--hung-timeout", type=float, default=60.0,
                   help="seconds a live worker may make no engine-loop progress before it is treated as dead "
                        "(its requests retried or failed); a slower worker only gets fewer new requests")
    p.add_argument("--no-migration", dest="migrate", action="store_false",
                   help="end a stream whose decode worker is lost with an error instead of continuing it on another")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let the streams in flight finish (new requests get 503) before exiting")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require this key on the OpenAI API (Authorization: Bearer KEY) and gRPC Generate "
                        "(metadata authorization: Bearer KEY); default $TANDEM_API_KEY. /health and /metrics stay open")
    p.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS",
                   help="judge every request's time to first token against this (SLO and goodput metrics)")
    p.add_argument("--itl-slo", type=float, default=None, metavar="SECONDS",
                   help="judge every request's mean inter-token latency against this")
    p.add_argument("--rebalance", action="store_true",
                   help="move workers between the prefill and decode roles when one role's SLO is missed while the "
                        "other has headroom (needs --ttft-slo and --itl-slo; zmq workers)")
    p.add_argument("--client-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="an HTTP request's head, then its body, must arrive within this (slow clients get 408)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="/metrics on the HTTP port needs the API key too (Prometheus: bearer_token); /health stays "
                        "open; --metrics-port serves an unguarded copy for a private network")
    p.add_argument("--enable-admin", action="store_true",
                   help="serve /admin/workers: drain a worker, or move it to the other role without a restart "
                        "(behind --api-key when set)")
    p.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                   help="serve tool_choice 'auto' (OpenAI's default with tools): read the calls the model writes "
                        "in this format out of its text (hermes: <tool_call>{...}</tool_call>, Hermes / Qwen "
                        "templates; llama3_json: Llama 3.x JSON calls; mistral: [TOOL_CALLS] calls; pythonic: "
                        "[f(a=1), g(b=2)] lists; vLLM's --enable-auto-tool-choice --tool-call-parser NAME)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="chat answers' <think>...</think> text goes to message.reasoning_content, the rest to "
                        "content (qwen3: Qwen3 / QwQ; deepseek_r1: DeepSeek-R1, whose template opens the block)")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM) for HTTP and gRPC")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM) for HTTP and gRPC")
    p.add_argument("--static-timeout", type=float, default=3.0,
                   help="seconds a static worker may go without answering the router's stats poll")
    p.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (for prefix affinity)")
    p.add_argument("--affinity-blocks", type=int, default=4,
                   help="prefix_affinity keys on this many leading blocks of the prompt")
    add_link_args(p)
    add_observability_args(p, worker=False)  # --metrics-port, --log-level, --log-prompts
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from router_svc.server import RouterConfig, serve
    from tandem.engine.strategies import resolve_routing_policy as resolve_policy
    from tandem.observability.logging import bind_service

    setup_logging(args)
    bind_service(service="router")
    apply_link_args(args)
    for policy in (args.decode_policy, args.prefill_policy):
        resolve_policy(policy)  # an unknown name fails here, before any port is bound
    config = RouterConfig(model=resolve_model(args.model), served_model_name=args.served_model_name, host=args.host,
                          http_port=args.http_port, grpc_port=args.grpc_port, listen=args.listen,
                          decode=args.decode, prefill=args.prefill, decode_policy=args.decode_policy,
                          prefill_policy=args.prefill_policy, max_inflight=args.max_inflight,
                          local_prefill_if_busy=args.local_prefill_if_busy,
                          static_timeout_s=args.static_timeout, heartbeat_misses=args.heartbeat_misses,
                          hung_timeout_s=args.hung_timeout, migrate=args.migrate,
                          drain_timeout_s=args.drain_timeout, api_key=args.api_key or None,
                          ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                          block_size=args.block_size, affinity_blocks=args.affinity_blocks,
                          metrics_port=args.metrics_port, enable_admin=args.enable_admin,
                          ttft_slo_s=args.ttft_slo, itl_slo_s=args.itl_slo, rebalance=args.rebalance,
                          client_timeout_s=args.client_timeout, protect_metrics=args.protect_metrics,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    asyncio.run(serve(config))
    return 0
