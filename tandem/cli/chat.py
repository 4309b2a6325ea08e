"""`tandem chat`: an interactive chat with a running router, streamed over gRPC.

Each user turn is appended to the conversation and the whole history is sent as a `chat` prompt
(the router renders it with the model's chat template), so the model sees every earlier turn; the
streamed reply is printed as it arrives and appended too. Interactive on a terminal (`/exit`,
`/reset`, Ctrl-D to quit, Ctrl-C to cut a reply short); with stdin piped, every input line is one
user turn and only the replies are printed, one after another, each ending with a newline.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator, TextIO

HELP = "commands: /exit (or Ctrl-D) quits, /reset clears the conversation, Ctrl-C stops a reply"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running tandem router (gRPC streaming)",
                       description="Interactive chat against `tandem up` / `tandem router` over gRPC. "
                                   "With stdin piped, each line is one user turn. " + HELP)
    p.add_argument("--url", default="127.0.0.1:50051", help="the router's gRPC address, host:port")
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="longest reply in tokens")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible replies)")
    p.add_argument("--model", default="", help="served model name (optional: checked by the router)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one reply may take")
    p.set_defaults(func=run)


class Conversation:
    """The chat history and one streaming call per turn."""

    def __init__(self, args: argparse.Namespace) -> None:
        import grpc

        from tandem.protocol import generation_pb2 as pb
        from tandem.protocol import generation_pb2_grpc

        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        self.pb, self.args = pb, args
        self.channel = grpc.insecure_channel(args.url)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.history: list[tuple[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.history = [("system", self.args.system)] if self.args.system else []

    def sampling(self):
        a, pb = self.args, self.pb
        params = pb.SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature)
        if a.top_p is not None:
            params.top_p = a.top_p
        if a.seed is not None:
            params.seed = a.seed
        return params

    def reply(self, user: str) -> Iterator[str]:
        """Stream the reply to `user`; the turn joins the history only when the reply ends (even cut short)."""
        pb = self.pb
        messages = [pb.ChatMessage(role=r, content=c) for r, c in [*self.history, ("user", user)]]
        call = self.stub.Generate(pb.GenerateRequest(chat=pb.ChatMessages(messages=messages),
                                                     sampling=self.sampling(), model=self.args.model),
                                  timeout=self.args.timeout)
        parts: list[str] = []
        try:
            for response in call:
                parts.append(response.text)
                yield response.text
        finally:
            call.cancel()  # a no-op after the last message; frees the KV blocks if we were interrupted
            self.history += [("user", user), ("assistant", "".join(parts))]

    def close(self) -> None:
        self.channel.close()


def run(args: argparse.Namespace) -> int:
    import grpc

    conv = Conversation(args)
    interactive = sys.stdin.isatty()
    try:
        if interactive:
            print(f"tandem chat with {args.url} — {HELP}", file=sys.stderr)
        return _loop(conv, interactive, sys.stdin, sys.stdout)
    except grpc.RpcError as exc:
        print(f"tandem chat: {exc.code().name}: {exc.details()} (is a router serving gRPC at {args.url}?)",
              file=sys.stderr)
        return 1
    finally:
        conv.close()


def _loop(conv: Conversation, interactive: bool, stdin: TextIO, out: TextIO) -> int:
    while True:
        try:
            text = _read_turn(interactive, stdin)
        except (EOFError, KeyboardInterrupt):  # Ctrl-D / end of the piped input / Ctrl-C at the prompt
            if interactive:
                print(file=out)
            return 0
        if text.strip() in ("/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            conv.reset()
            continue
        if interactive and not text.strip():
            continue
        if interactive:
            print("assistant> ", end="", file=out, flush=True)
        try:
            for piece in conv.reply(text):
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:  # Ctrl-C during a reply: it is cancelled, the chat goes on
            if not interactive:
                raise
        out.write("\n")
        out.flush()


def _read_turn(interactive: bool, stdin: TextIO) -> str:
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input(), where available)
        except ImportError:
            pass
        return input("you> ")
    line = stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")
