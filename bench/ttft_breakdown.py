"""Where a request's time to first token goes under `tandem up`: each stage's delay after the client sent
the request, at p50 / p90 / max, from the workers' own traces.

    python -m bench.ttft_breakdown [--rate 8] [--num-prompts 40] [--input-len 256] [--output-len 64]
                                   [--up-args "--colocated"] [--model DIR]

Starts `tandem up` (P/D unless --up-args says otherwise), sends streamed completions of random token-id
prompts with Poisson arrivals (`--rate` req/s; 0 = one after another), each with its own `x-request-id`,
then asks every worker for that request's trace (the `trace` control message: CLOCK_MONOTONIC stamps,
comparable across processes on one host): D added it, sent it to P, P received it, pushed layer 0,
computed the last layer, sent `done`, D had the KV, D sent the first token, the client read it. A stage
whose p90 grows with the rate is where the queue is. Not a ratio against a peer: a map for the TTFT gap
that `bench/serve_peer.py` measures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import zmq

from bench.servers import Server, free_port, tandem_cli, warm_up
from tandem.protocol import messages


def trace(address: str, rid: str) -> dict[str, int]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(messages.encode("trace", id=rid))
        while sock.poll(5000):
            msg = messages.decode(sock.recv())
            if msg["type"] == "trace_reply":
                return msg["events"]
        raise RuntimeError(f"no trace_reply from {address}")
    finally:
        sock.close()


def ready_line(log: Path, timeout_s: float = 30.0) -> dict:
    """`tandem up`'s ready line (the workers' control addresses), once it reaches the log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("tandem-up-ready "):
                return json.loads(line.split(" ", 1)[1])
        time.sleep(0.2)
    raise RuntimeError(f"no tandem-up-ready line in {log}")


def stream(base: str, rid: str, prompt: list[int], output_len: int) -> tuple[int, int | None]:
    """(sent, first chunk read) in CLOCK_MONOTONIC ns."""
    body = json.dumps({"prompt": prompt, "max_tokens": output_len, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json", "x-request-id": rid})
    sent, first = time.monotonic_ns(), None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            if first is None and raw.startswith(b"data:"):
                first = time.monotonic_ns()
    return sent, first


def table(rows: list[dict]) -> None:
    """Each stage's p50 / p90 / max over `rows`, stages in order of their medians."""
    def median(k: str) -> float:
        xs = sorted(r[k] for r in rows if k in r)
        return xs[len(xs) // 2]
    print(f"{'stage':<38} {'p50':>8} {'p90':>8} {'max':>8}")
    for k in sorted({k for r in rows for k in r if k != "sent_ns"}, key=median):
        xs = sorted(r[k] for r in rows if k in r)
        print(f"{k:<38} {xs[len(xs) // 2]:8.1f} {xs[int(len(xs) * 0.9)]:8.1f} {xs[-1]:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="prompt lengths drawn from [input-len x (1 - R), input-len x (1 + R)], as serve_peer's")
    p.add_argument("--up-args", default="", help="more `tandem up` arguments, e.g. '--colocated'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", help="write every request's stage times (ms, in send order) to this JSON file")
    a = p.parse_args()
    port, run_dir = free_port(), Path(tempfile.mkdtemp(prefix="ttft_breakdown-"))
    cmd = [*shlex.split(tandem_cli()), "up", "--http-port", str(port), "--grpc-port", "0",
           *(["--model", a.model] if a.model else []), *shlex.split(a.up_args)]
    server = Server("tandem", cmd, dict(os.environ), port, run_dir / "tandem.log")
    try:
        server.wait_ready(600)
        ready = ready_line(server.log)
        model = json.loads(urllib.request.urlopen(server.base + "/v1/models").read())["data"][0]["id"]
        warm_up(server.base, model, a.input_len)
        rng, sent = random.Random(a.seed), {}
        low, high = round(a.input_len * (1 - a.range_ratio)), round(a.input_len * (1 + a.range_ratio))

        def length(rng: random.Random) -> int:
            return rng.randint(max(1, low), max(1, high))

        vocab = 2000  # token ids every shipped tokenizer has; the prompt's text does not matter here

        def one(rid: str, prompt: list[int]) -> None:
            sent[rid] = stream(server.base, rid, prompt, a.output_len)

        threads = []
        for i in range(a.num_prompts):
            rid = f"ttft-{os.getpid()}-{i}"
            t = threading.Thread(target=one, args=(rid, [rng.randrange(10, vocab) for _ in range(length(rng))]))
            t.start()
            if a.rate <= 0:
                t.join()
            threads.append(t)
            if a.rate > 0:
                time.sleep(rng.expovariate(a.rate))
        for t in threads:
            t.join()
        rows = []
        for rid, (t0, first) in sent.items():
            events = {"client.first_chunk": first}
            for name, worker in ready["workers"].items():
                events.update({f"{name}.{k.removesuffix('_ns')}": v for k, v in trace(worker["control"], rid).items()})
            rows.append({k: (v - t0) / 1e6 for k, v in events.items() if v is not None} | {"sent_ns": t0})
    finally:
        server.stop()
    rows.sort(key=lambda r: r["sent_ns"])  # send order (the client's CLOCK_MONOTONIC ns, kept in --dump)
    # Two paths when the router keeps some prompts on D (--local-prefill-if-busy): a table for each.
    remote = [r for r in rows if any(k.startswith("prefill-") for k in r)]
    local = [r for r in rows if r not in remote]
    span = f"{a.input_len}" if not a.range_ratio else f"{low}-{high}"
    print(f"{len(rows)} requests, {a.rate:g} req/s, {span}-token prompts; ms after the client sent each")
    for name, group in (("prefilled by a prefill worker", remote), ("prefilled by their decode worker", local)):
        if group and (remote and local):
            print(f"-- {len(group)} {name}")
        if group:
            table(group)
    print(f"server log: {server.log}")
    if a.dump:
        Path(a.dump).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
