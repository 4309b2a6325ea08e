"""`tandem generate "prompt"`: run the engine in-process and stream the completion to the terminal."""

from __future__ import annotations

import argparse
import sys

from tandem.cli.engine_args import add_engine_args, add_model_arg, engine_config_from_args, resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal",
                       description="Generate a completion in-process. With no --model, uses the built-in "
                                   "default model (a small Llama trained on Python source, shipped in the package).")
    p.add_argument("prompt", help="prompt text")
    add_model_arg(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tandem.engine.llm_engine import LLMEngine
    from tandem.observability.logging import configure_logging
    from tandem.sampling_params import SamplingParams

    configure_logging("warning")  # the engine's log lines on stderr, warnings only: stdout is this command's output
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)
    engine = LLMEngine(engine_config_from_args(args, resolve_model(args.model)))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    rid = engine.add_request(None, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
