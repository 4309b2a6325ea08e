"""Prefill/decode interference through the front door: `vllm serve` (its default chunked prefill) beside
`tandem up` P/D and colocated, same checkpoint, same open-loop load, one after the other.

    python -m bench.interference_serve --vllm-python PATH [--model DIR] [--streams 8] [--prompt-len 2000]
                                       [--arrivals 3] [--window 25] [--modes vllm,tandem-pd,tandem-colocated]

Per server, two phases on the streaming OpenAI completions API (bench/stream_client.py: exact arrival
times, a timestamp per SSE chunk):
  baseline    `--streams` decoding streams (32-token random prompts, 512 tokens, greedy, ignore_eos;
              one that finishes is replaced at once) alone;
  arrivals    the same streams while a `--prompt-len` prompt of fresh random tokens (no prefix hits,
              4 output tokens) arrives every `--arrivals` seconds for `--window` seconds.
ITL = the gap between consecutive tokens of one stream whose later token falls inside the window
(every request asks for logprobs, so each token is timed even where its text is empty). The issue's
target: under arrivals tandem P/D's ITL p99 is at least 3x lower than `vllm serve`'s.
bench/interference.py measures the same thing on tandem's workers directly (no router, per-core
pinning); this one goes through each server's own HTTP stack and CPU placement (`tandem up`'s plan;
vLLM's thread binding), as a user would run them.
Default model: the 55M benchmark Llama (bench/offline_throughput.py's, 2048 positions), built if absent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from bench.serve_peer import server_cmd
from bench.servers import Server, free_port, tandem_cli, warm_up
from bench.stream_client import Received, Sent, stream_one

STREAM_PROMPT, STREAM_TOKENS, LEAD_S = 32, 512, 3.0  # arrivals (and the ITL window) start after LEAD_S


async def _phase(base: str, model: str, a, arrivals: bool, seed: int) -> tuple[list[Received], list[Received], float]:
    """Closed-loop streams (a finished one is replaced at once) until the window ends, and open-loop
    long prompts inside it. Returns (stream results, long-prompt results, start time)."""
    url = urlparse(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    rng = random.Random(seed)
    start = time.perf_counter()
    end = start + LEAD_S + a.window
    streams: list[Received] = []
    longs = [Received() for _ in range(int(a.window / a.arrivals) if arrivals else 0)]

    async def send(sent: Sent, out: Received, timeout: float) -> None:
        try:
            await asyncio.wait_for(stream_one(host, port, model, sent, out, timeout, per_token=True), timeout)
        except (OSError, asyncio.TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"

    async def slot() -> None:
        while time.perf_counter() < end:
            out = Received()
            streams.append(out)
            prompt = [rng.randrange(3, a.vocab) for _ in range(STREAM_PROMPT)]
            await send(Sent(0.0, prompt, STREAM_TOKENS), out, end - time.perf_counter() + 60)

    async def long_prompt(i: int) -> None:
        await asyncio.sleep(start + LEAD_S + i * a.arrivals - time.perf_counter())
        await send(Sent(0.0, [rng.randrange(3, a.vocab) for _ in range(a.prompt_len)], 4), longs[i], 120)

    await asyncio.gather(*(slot() for _ in range(a.streams)), *(long_prompt(i) for i in range(len(longs))))
    return streams, longs, start


def window_gaps(streams: list[Received], start: float, end: float) -> list[float]:
    """Gaps (s) between consecutive chunks of one stream whose later chunk lies in [start, end)."""
    return [b - x for r in streams for x, b in zip(r.chunk_times, r.chunk_times[1:]) if start <= b < end]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def run_mode(a, mode: str, served: str, env: dict, run_dir: Path) -> dict:
    port = free_port()
    server = Server(mode, server_cmd(a, mode, port, served), env, port, run_dir / f"{mode}.log")
    try:
        server.wait_ready(a.startup_timeout)
        warm_up(server.base, served, 256)
        row: dict = {"mode": mode}
        for phase, arrivals in (("baseline", False), ("arrivals", True)):
            streams, longs, t0 = asyncio.run(_phase(server.base, served, a, arrivals, seed=int(arrivals)))
            gaps = window_gaps(streams, t0 + LEAD_S, t0 + LEAD_S + a.window)
            errors = [r.error for r in streams + longs if r.error]
            ttft = [r.ttft_s for r in longs if r.ttft_s is not None]
            row[phase] = {"gaps": len(gaps), "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99),
                          "itl_max_ms": pct(gaps, 1.0), "errors": errors[:3], "long_prompts": len(longs),
                          "long_prompt_ttft_p50_s": statistics.median(ttft) if ttft else None}
            print(f"[{mode}] {phase}: {json.dumps(row[phase])}", flush=True)
        return row
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", help="python of a venv with vLLM (needed for the vllm mode)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the 55M benchmark Llama)")
    p.add_argument("--tandem-cmd", default=tandem_cli())
    p.add_argument("--tandem-args", default="", help="more `tandem up` arguments for every tandem mode")
    p.add_argument("--modes", default="vllm,tandem-pd,tandem-colocated")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--arrivals", type=float, default=3.0, help="seconds between long prompts")
    p.add_argument("--window", type=float, default=25.0)
    p.add_argument("--startup-timeout", type=float, default=600)
    a = p.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if "vllm" in modes and not (a.vllm_python and Path(a.vllm_python).exists()):
        p.error("the vllm mode needs --vllm-python (a venv with vLLM); or leave it out of --modes")
    run_dir = Path(tempfile.mkdtemp(prefix="interference_serve-"))
    if a.model is None:
        from bench.offline_throughput import build_model

        a.model = str(run_dir / "model")
        build_model(a.model)
    a.model = str(Path(a.model).resolve())
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    a.max_model_len = cfg.get("max_position_embeddings", 2048)
    if a.prompt_len + 4 > a.max_model_len:
        p.error(f"--prompt-len + 4 exceeds the model's {a.max_model_len} positions")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("OMP_NUM_THREADS", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    print(f"run directory (server logs): {run_dir}; load average {os.getloadavg()}", flush=True)
    a.vocab = cfg["vocab_size"]
    rows = [run_mode(a, m, Path(a.model).name, env, run_dir) for m in modes]
    vllm_p99 = next((r["arrivals"]["itl_p99_ms"] for r in rows if r["mode"] == "vllm"), None)
    print(f"\n{'mode':>17} {'base p50':>9} {'base p99':>9} {'arr p50':>8} {'arr p99':>8} {'arr max':>8} "
          f"{'p99/base':>8} {'vllm p99 / this':>15}  (ms; long-prompt TTFT p50)")
    for r in rows:
        b, w = r["baseline"], r["arrivals"]
        ratio = f"{vllm_p99 / w['itl_p99_ms']:.2f}x" if vllm_p99 else "-"
        print(f"{r['mode']:>17} {b['itl_p50_ms']:9.2f} {b['itl_p99_ms']:9.2f} {w['itl_p50_ms']:8.2f} "
              f"{w['itl_p99_ms']:8.2f} {w['itl_max_ms']:8.1f} {w['itl_p99_ms'] / b['itl_p99_ms']:8.2f} "
              f"{ratio:>15}  ({w['long_prompt_ttft_p50_s'] or float('nan'):.2f} s)")
    (run_dir / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"results: {run_dir / 'results.json'}")


if __name__ == "__main__":
    main()
