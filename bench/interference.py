"""Prefill/decode interference: inter-token latency (ITL) of decoding streams while long prompts keep
arriving, colocated (with and without chunked prefill) vs disaggregated; real worker processes on
loopback, driven over the control protocol (no router).

    python -m bench.interference [--streams 8] [--prompt-len 2000] [--arrivals auto|SECONDS]
                                 [--window 45] [--baseline 12] [--chunk 256] [--model PATH] [--quick]

Setups, each its own `python -m tandem.cli` processes:
  colocated, no chunking   `tandem decode --kv-connector none --no-enable-chunked-prefill`    core 1
  colocated, chunked       `tandem decode --kv-connector none --max-num-batched-tokens 256`   core 1
  disaggregated P+D        `tandem prefill` (core 0) + `tandem decode --kv-connector zmq
                           --local-prefill-threshold 0` (core 1): every prompt goes through P
Baselines: the same streams with no arrivals in the colocated worker and in the disaggregated D, and
a control: that D with no arrivals while a busy loop runs on P's core. On a shared machine a busy core
0 pushes other jobs onto core 1 and slows D though P sends it nothing; disaggregated / control is what
D's own extra work (receiving KV, the prompts' few decode steps) costs.

A phase: start `--streams` requests (32-token prompt, greedy, ignore_eos, up to max_model_len; one that
finishes is replaced), wait for a few tokens of each, then for `--window` seconds send a `--prompt-len`
prompt of fresh random tokens (no prefix hits, max_tokens `--prompt-max-tokens` = 4) every
`--arrivals` seconds. ITL = gap between consecutive tokens of one stream as received here
(perf_counter at recv), both inside the window; a message with k tokens counts as one gap plus k-1
zeros. Disaggregated D runs with `--prefill-timeout 300` (a prompt queued at a busy P must not fall
back to a local prefill) and the bench prints D's stats to show every prompt was computed by P.

`--arrivals auto` = 1.5x one prompt's prefill on the idle colocated worker (P ~2/3 busy). One 2k prompt
every 0.5-1 s suits a GPU; one CPU core needs seconds per prompt, so such a rate would grow a queue
without bound and the colocated numbers would depend on the window length.

CPU caveat: on a 2-core box P and D share the machine, so disaggregation cannot isolate compute as two
GPUs do. OMP_NUM_THREADS=1 everywhere; once ready, every thread of a worker is pinned (later threads
inherit the mask): P on core 0, D on core 1, the colocated worker on core 1 alone -- D alone on a core
vs D + P each on its own. The client is unpinned. All workers start together, unpinned (start-up
dominates on a loaded box), then wait parked on core 0 until their setup runs; the table shows the CPU
time those idle workers used during each window.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.interference_client import Driver
from bench.interference_procs import Worker, burner, pin, spawn, stop, wait_ready
from bench.offline_throughput import build_model

STREAM_PROMPT_LEN, WARM_TOKENS = 32, 3
# phase labels: the table rows, and the keys of the ratios
BASE_COLOC, NOCHUNK, CHUNKED = "no arrivals (colocated)", "colocated, no chunking", "colocated, chunked"
BASE_DISAGG, DISAGG = "no arrivals (disaggregated D)", "disaggregated P+D"
CONTROL = "no arrivals, core 0 busy (control)"


@dataclass
class Phase:
    label: str
    cores: str
    gaps: list[float] = field(default_factory=list)
    arrivals: int = 0
    ttfts: list[float] = field(default_factory=list)  # arrivals' time to first token
    idle_cpu_s: float = 0.0
    busy: float = 0.0  # the measured decode worker's CPU time / window
    waited: float = 0.0  # its run-queue wait / window


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


class Bench:
    def __init__(self, args: argparse.Namespace, vocab: int, max_model_len: int) -> None:
        # args: streams, prompt_len, prompt_max_tokens, window, baseline, seed
        self.args, self.vocab, self.max_model_len = args, vocab, max_model_len
        self.rng = random.Random(args.seed)
        self.n = 0  # request id counter: ids stay unique across phases
        self.interval: float | None = None  # seconds between arrivals (auto: set by the first setup)

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(length)]

    def rid(self, kind: str) -> str:
        self.n += 1
        return f"{kind}-{self.n}"

    def prefill_time(self, d: Driver, peer: str | None) -> float:
        """Time to first token of one prompt on an idle worker (after a short warm-up request)."""
        for length in (64, self.args.prompt_len):
            rid = self.rid("cal")
            d.add(rid, self.prompt(length), 1, peer)
            d.wait(lambda: rid in d.finished, 300, f"calibration prompt of {length} tokens")
        return d.times[rid][0] - d.sent[rid]

    def phase(self, d: Driver, peer: str | None, label: str, cores: str, window: float, interval: float | None,
              measured: Worker, idle: list[Worker], drain: bool) -> Phase:
        streams: list[str] = []
        stream_tokens = self.max_model_len - STREAM_PROMPT_LEN

        def new_stream() -> None:
            streams.append(self.rid("stream"))
            d.add(streams[-1], self.prompt(STREAM_PROMPT_LEN), stream_tokens, peer)

        for _ in range(self.args.streams):
            new_stream()
        d.wait(lambda: all(len(d.times[s]) >= WARM_TOKENS for s in streams), 300, "the streams to start")
        live = set(streams)
        arrivals: list[str] = []
        cpu0 = sum(w.cpu_seconds() for w in idle)
        busy0, wait0 = measured.cpu_seconds(), measured.runqueue_wait_seconds()
        t0 = time.perf_counter()
        next_arrival = t0 if interval else math.inf
        while (now := time.perf_counter()) < t0 + window:
            if now >= next_arrival:
                arrivals.append(self.rid("prompt"))
                d.add(arrivals[-1], self.prompt(self.args.prompt_len), self.args.prompt_max_tokens, peer)
                next_arrival += interval
            d.pump(min(next_arrival, t0 + window) - now)
            for s in [s for s in live if s in d.finished]:  # keep --streams decoding
                live.discard(s)
                new_stream()
                live.add(streams[-1])
        t1 = time.perf_counter()
        res = Phase(label, cores, arrivals=len(arrivals), idle_cpu_s=sum(w.cpu_seconds() for w in idle) - cpu0,
                    busy=(measured.cpu_seconds() - busy0) / (t1 - t0),
                    waited=(measured.runqueue_wait_seconds() - wait0) / (t1 - t0))
        for s in streams:
            ts = d.times[s]
            res.gaps += [b - a for a, b in zip(ts, ts[1:]) if a >= t0 and b <= t1]  # ts[0] itself is TTFT
        res.ttfts = [d.times[a][0] - d.sent[a] for a in arrivals if d.times[a]]
        if drain:  # leave the worker idle for the next phase: abort everything still running, wait for the acks
            pending = [r for r in streams + arrivals if r not in d.finished]
            for r in pending:
                d.abort(r)
            d.wait(lambda: all(r in d.finished for r in pending), 120, "aborted requests to finish")
        return res


def engine_flags(args: argparse.Namespace, max_model_len: int, role: str) -> list[str]:
    per_seq = -(-max_model_len // 16)
    # D holds every stream's whole context plus the prompts in flight; P only prompts (prefix cache).
    blocks = (args.streams * per_seq if role == "decode" else 0) + 8 * (-(-args.prompt_len // 16)) + 64
    return ["--num-kv-blocks", str(blocks), "--max-model-len", str(max_model_len)]


def print_report(phases: list[Phase], prefill_s: dict[str, float], interval: float, load0, load1) -> None:
    print(f"\n{'setup':<38}{'cores':<12}{'arrivals':>8}{'TTFT p50':>10}{'ITL p50':>10}{'ITL p99':>10}"
          f"{'ITL max':>10}{'gaps':>7}{'D cpu':>7}{'D wait':>7}{'idle cpu':>9}")
    for p in phases:
        ttft = f"{pct(p.ttfts, 0.5):.2f}s" if p.ttfts else "-"
        print(f"{p.label:<38}{p.cores:<12}{p.arrivals:>8}{ttft:>10}{pct(p.gaps, .5) * 1e3:>8.1f}ms"
              f"{pct(p.gaps, .99) * 1e3:>8.1f}ms{max(p.gaps, default=math.nan) * 1e3:>8.1f}ms{len(p.gaps):>7}"
              f"{p.busy:>7.0%}{p.waited:>7.0%}{p.idle_cpu_s:>8.2f}s")
    by = {p.label: pct(p.gaps, 0.99) for p in phases}
    dis, base = by[DISAGG], by[BASE_DISAGG]
    print("\none prompt alone, to its first token: " + ", ".join(f"{k} {v:.2f}s" for k, v in prefill_s.items())
          + f"; arrivals: one prompt every {interval:.2f}s")
    print(f"disaggregated p99 / no-arrival p99 (same D):      {dis / base:6.2f}x  (target <= 1.5x)")
    print(f"disaggregated p99 / control p99 (core 0 busy):    {dis / by[CONTROL]:6.2f}x  "
          "(what D's own extra work costs: KV receive, the prompts' few decode steps)")
    print(f"colocated no-chunk p99 / disaggregated p99:       {by[NOCHUNK] / dis:6.2f}x  (target >= 3x)")
    print(f"colocated chunked p99 / disaggregated p99:        {by[CHUNKED] / dis:6.2f}x")
    print(f"load average (1/5/15 min) at start {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
          f"at end {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f} on {os.cpu_count()} CPUs")
    print("note: P pinned to core 0, D and the colocated worker to core 1, OMP_NUM_THREADS=1; P and D still share "
          "one machine (memory bandwidth, caches, other jobs), which two GPUs would not.\n"
          "TTFT p50: the arriving prompts' time to first token (queueing included); "
          "D cpu: the measured worker's CPU time (all threads) / window; D wait: its main thread's run-queue wait / "
          "window (> 0: something else ran on its core); idle cpu: what idle workers of later setups used meanwhile.")


def run_setup(bench: Bench, workers: dict[str, Worker], keys: list[str], phases: list[tuple[str, bool, bool]],
              prefill_s: dict[str, float]) -> list[Phase]:
    """Pin this setup's workers, warm up and time one prompt alone, then run `phases` (label, with
    arrivals?, core 0 busy?) on the decode worker (the last key); P, if in `keys`, computes every prompt."""
    for k in keys:
        pin(workers[k], workers[k].cores)
    measured = workers[keys[-1]]
    peer = workers["P"].control if "P" in keys else None
    cores = " ".join(f"{'P' if k == 'P' else 'D'}:{sorted(workers[k].cores or [])}" for k in keys)
    idle = [w for k, w in workers.items() if k not in keys and w.popen.poll() is None]
    d, out = Driver(measured.control), []
    try:
        prefill_s[phases[-1][0]] = bench.prefill_time(d, peer)
        if bench.interval is None:  # auto: set by the first setup, used by all
            bench.interval = 1.5 * prefill_s[phases[-1][0]]
        print(f"  {phases[-1][0]}: one {bench.args.prompt_len}-token prompt alone takes "
              f"{prefill_s[phases[-1][0]]:.2f}s to its first token", flush=True)
        for i, (label, arrivals, busy) in enumerate(phases):
            window = bench.args.window if arrivals else bench.args.baseline
            hog = burner(workers["P"].cores) if busy else None
            try:
                out.append(bench.phase(d, peer, label, cores, window, bench.interval if arrivals else None,
                                       measured, idle, drain=i + 1 < len(phases)))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            p = out[-1]
            print(f"  {label}: {p.arrivals} arrivals, ITL p50 {pct(p.gaps, .5) * 1e3:.1f}ms "
                  f"p99 {pct(p.gaps, .99) * 1e3:.1f}ms ({len(p.gaps)} gaps)", flush=True)
        if peer is not None:  # every prompt must really have been computed by P
            st = d.request_stats()
            print(f"  D stats: remote_prefills={st['remote_prefills']} local_prefills={st['local_prefills']} "
                  f"fallbacks={st['fallbacks']} preemptions={st['preemptions']}", flush=True)
            if st["local_prefills"] or st["fallbacks"]:
                print("  WARNING: D computed prompts itself; the disaggregated numbers include local prefills")
    finally:
        d.close()
        stop([workers[k] for k in keys])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: build the benchmark model)")
    ap.add_argument("--streams", type=int, default=8, help="decoding streams whose ITL is measured")
    ap.add_argument("--prompt-len", type=int, default=2000, help="tokens per arriving prompt")
    ap.add_argument("--prompt-max-tokens", type=int, default=4,
                    help="max_tokens of each arriving prompt (1: it never decodes on D)")
    ap.add_argument("--arrivals", default="auto", help="seconds between arriving prompts, or auto (1.5x one prefill)")
    ap.add_argument("--window", type=float, default=45.0, help="seconds of arrivals per setup")
    ap.add_argument("--baseline", type=float, default=12.0, help="seconds of each no-arrival phase")
    ap.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens of the chunked setup")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 256-token prompts, short phases")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.window, args.baseline = 256, 6.0, 3.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks below
    load0 = os.getloadavg()
    cpus = sorted(os.sched_getaffinity(0))
    p_core, d_core = ({cpus[0]}, {cpus[1]}) if len(cpus) >= 2 else (None, None)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-interference-"))
    model = args.model
    if model is None:  # the 55M benchmark Llama, built in the run's temp dir
        model = str(tmp / "model")
        build_model(model)
    cfg = json.loads((Path(model) / "config.json").read_text())
    max_model_len = min(cfg.get("max_position_embeddings", 2048), 8192)
    if args.prompt_len + args.prompt_max_tokens > max_model_len:
        raise SystemExit(f"--prompt-len + --prompt-max-tokens exceed max_model_len {max_model_len}")
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; cores {cpus}; "
          f"P on {p_core}, D/colocated on {d_core}; streams={args.streams} prompt_len={args.prompt_len} "
          f"window={args.window}s baseline={args.baseline}s chunk={args.chunk}", flush=True)
    d_flags, p_flags = engine_flags(args, max_model_len, "decode"), engine_flags(args, max_model_len, "prefill")
    workers = {
        "nochunk": spawn("colocated-nochunk", "decode", model, tmp, d_core,
                         [*d_flags, "--kv-connector", "none", "--no-enable-chunked-prefill"]),
        "chunked": spawn("colocated-chunked", "decode", model, tmp, d_core,
                         [*d_flags, "--kv-connector", "none", "--max-num-batched-tokens", str(args.chunk)]),
        "P": spawn("prefill", "prefill", model, tmp, p_core, [*p_flags, "--kv-connector", "zmq"]),
        # --prefill-timeout: a prompt queued behind others at a loaded P makes no KV progress for a while;
        # the default 30 s would send it back to D for a local prefill, the very interference measured here.
        "D": spawn("decode", "decode", model, tmp, d_core,
                   [*d_flags, "--kv-connector", "zmq", "--local-prefill-threshold", "0", "--prefill-timeout", "300"]),
    }
    ok = False
    try:
        t = time.perf_counter()
        for key, w in workers.items():
            # Parked on P's core: during the colocated setups nothing of ours but the measured worker runs
            # on core 1 (an idle worker still wakes every 20 ms to poll its socket).
            wait_ready(w, "prefill" if key == "P" else "decode", p_core)
        print(f"workers ready in {time.perf_counter() - t:.1f}s", flush=True)
        bench = Bench(args, cfg["vocab_size"], max_model_len)
        bench.interval = None if args.arrivals == "auto" else float(args.arrivals)
        prefill_s: dict[str, float] = {}
        phases = run_setup(bench, workers, ["nochunk"], [(BASE_COLOC, False, False), (NOCHUNK, True, False)],
                           prefill_s)
        phases += run_setup(bench, workers, ["chunked"], [(CHUNKED, True, False)], prefill_s)
        phases += run_setup(bench, workers, ["P", "D"], [(BASE_DISAGG, False, False), (CONTROL, False, True),
                                                        (DISAGG, True, False)], prefill_s)
        print_report(phases, prefill_s, bench.interval, load0, os.getloadavg())
        ok = True
    finally:
        stop(list(workers.values()))
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            if args.model is None:
                shutil.rmtree(model, ignore_errors=True)
            print(f"worker logs kept in {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()
