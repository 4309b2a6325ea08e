"""tandem vs vLLM's CPU build on the same checkpoint and requests, in one run: offline throughput with
greedy agreement, batch-1 decode beside the weight-bandwidth limit, and (opt-in) serving and interference.

    python -m bench.peer_vllm --vllm-python /work/vllm-venv/bin/python [--model DIR] [--threads N]
        [--requests 64] [--decode-tokens 128] [--repeats 3] [--rounds 1] [--quick] [--serve] [--interference]
        [--out FILE]

1. offline: the seeded workload of bench/offline_throughput.py (64 requests, prompts U[32, 512], outputs
   U[16, 256], ignore_eos, greedy, token-id prompts) through `vllm.LLM.generate` and `tandem.LLM.generate`,
   each in its own subprocess, one after the other, with the same thread count (vLLM's OpenMP team bound
   to cores 0..N-1 through VLLM_CPU_OMP_THREADS_BIND; `--vllm-bind auto` keeps vLLM's default, which
   reserves a core for its scheduler). Output tok/s each, the ratio, and the requests whose greedy tokens
   agree exactly (both fp32).
2. batch-1 decode: in the same subprocesses, one 32-token prompt generating 1 token and one generating
   1 + `--decode-tokens` (fresh random prompts each time, so no prefix-cache hits), `--repeats` times;
   decode tok/s = decode tokens / (median long - median short). The limit: streaming-read bandwidth
   (this process, same thread count, the better of right before and right after that engine's run;
   memcpy is printed beside it) / the weight bytes a decode step reads (every weight but the embedding
   table, of which it reads one row). "of limit" is the median over rounds of each round's rate over its
   own limit: this VM's bandwidth drifts 20-30% within minutes (one limit for the whole run put the same
   engine at 73% and 105% in two runs an hour apart).
3. `--serve`: bench/serve_peer.py (vllm serve, tandem up P/D and colocated, one client) with
   `--serve-args` passed through.
4. `--interference`: bench/interference.py (tandem colocated and P/D, workers driven directly); the same
   workload against `vllm serve` through each server's HTTP API is bench/interference_serve.py.

`--rounds R` runs each engine R times in fresh processes, alternating which goes first (this VM's
speed drifts by 5-10% over minutes), and reports the medians; the JSON keeps every round.

`--quick` is a smoke run: 8 requests, 32 decode tokens, 1 repeat. Without --model the benchmark's random
55M Llama (bench/offline_throughput.build_model) is built in a temporary directory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One driver for both engines: `make_llm`/`generate`/`token_lists` are the only engine-specific parts.
CHILD = r"""
import json, random, statistics, sys, time
engine, path, work_file, decode_tokens, repeats = sys.argv[1:6]
decode_tokens, repeats = int(decode_tokens), int(repeats)
work = json.load(open(work_file))
if engine == "tandem":
    import torch
    from tandem import LLM, SamplingParams
    from tandem.layers import linear
    llm = LLM(path, max_model_len=1024, kv_cache_memory_gb=2.0, max_num_seqs=64, max_num_batched_tokens=2048)
    def generate(prompts, params):
        return [o.token_ids for o in llm.generate(prompts, params)]
    info = {"torch_threads": torch.get_num_threads(), "linear": linear.backend()}
else:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=path, dtype="float32", max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048,
              seed=0)
    def generate(prompts, params):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    info = {}
def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
generate([[5] * 64, [6] * 300], [greedy(8), greedy(8)])  # warm-up: page faults, allocator, first kernels
t = time.perf_counter()
toks = generate([p for p, _ in work], [greedy(o) for _, o in work])
offline_s = time.perf_counter() - t
rng = random.Random(1)
def timed(n):
    prompt = [rng.randrange(3, 32000) for _ in range(32)]
    t = time.perf_counter()
    got = generate([prompt], [greedy(n)])
    dt = time.perf_counter() - t
    assert len(got[0]) == n, (len(got[0]), n)
    return dt
timed(decode_tokens + 1)  # warm the batch-1 shapes
short = statistics.median(timed(1) for _ in range(repeats))
long = statistics.median(timed(decode_tokens + 1) for _ in range(repeats))
print("RESULT", json.dumps({"offline_s": offline_s, "tokens": [list(map(int, x)) for x in toks],
                            "b1_short_s": short, "b1_long_s": long, "info": info}))
"""


def run_engine(name: str, python: str, model: str, work_file: str, env: dict, decode_tokens: int,
               repeats: int) -> dict:
    cmd = [python, "-c", CHILD, name, model, work_file, str(decode_tokens), str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{name} ({python}) exited {out.returncode}:\n{out.stderr[-3000:]}")
    r = json.loads(line.split(" ", 1)[1])
    r["b1_tok_s"] = decode_tokens / (r["b1_long_s"] - r["b1_short_s"])
    return r


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I8": 1}


def median_run(runs: list[dict]) -> dict:
    """One engine's rounds as one result: the median offline time and batch-1 rate (the tokens, for the
    agreement check, are the first round's; every round is greedy on the same requests)."""
    return {**runs[0], "offline_s": statistics.median(r["offline_s"] for r in runs),
            "b1_tok_s": statistics.median(r["b1_tok_s"] for r in runs)}


def decode_weight_bytes(model: str) -> int:
    """Bytes of weights one decode step streams: all but the embedding table (one row of it is read),
    which counts once more when the LM head is tied to it."""
    from safetensors import safe_open

    with open(os.path.join(model, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    total = 0
    with safe_open(os.path.join(model, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.endswith("embed_tokens.weight") and not tied:
                continue
            t = f.get_slice(name)
            n = 1
            for d in t.get_shape():
                n *= d
            total += n * _DTYPE_BYTES[t.get_dtype()]
    return total


def read_gbps() -> float:
    """Streaming-read bandwidth: a decode step only reads its weights, so this, not memcpy (which also
    writes), is its ceiling. A 256 MiB buffer (far past any L3 here) reduced by torch, best of 8, in 4 KiB
    pages and in 2 MiB pages (where tandem keeps CPU weights: tandem/models/weight_arena.py), as one sum and
    as 16 row sums (each thread then reads several streams: 33-36 GB/s here where one sum read 30-31, and
    tandem's own four-stream linear kernel 33-42): the fastest of them, the best this memory reads."""
    import time

    from tandem.models.weight_arena import hugepage_empty

    nbytes = 256 * 2**20
    best = float("inf")
    for buf in (torch.ones(nbytes // 4), hugepage_empty(nbytes).view(torch.float32).fill_(1.0)):
        for reduce in (lambda: buf.sum(), lambda: buf.view(16, -1).sum(1)):
            for _ in range(8):
                t = time.perf_counter()
                reduce()
                best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def versions(vllm_python: str | None) -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    if vllm_python:
        out = subprocess.run([vllm_python, "-c", "import importlib.metadata as m, torch; "
                              "print(m.version('vllm-cpu'), torch.__version__)"], capture_output=True, text=True)
        parts = out.stdout.split()
        if len(parts) == 2:
            v["vllm-cpu"], v["vllm_torch"] = parts
    return v


def passthrough(module: str, args: list[str]) -> int:
    cmd = [sys.executable, "-m", module, *args]
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    return subprocess.call(cmd, cwd=REPO)


def main() -> None:
    from bench.offline_throughput import build_model, memcpy_gbps, workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", help="interpreter of a venv with vllm-cpu (never installed here)")
    ap.add_argument("--model", help="HF checkpoint directory (default: build the random 55M benchmark Llama)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vllm-bind", default="all", help="all: bind vLLM's OpenMP team to cores 0..threads-1; "
                    "auto: vLLM's default (reserves a core); or a VLLM_CPU_OMP_THREADS_BIND value")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="tandem,vllm")
    ap.add_argument("--rounds", type=int, default=1, help="run the engines this many times, alternating which "
                    "goes first; the table gives each engine's median and the ratio of the medians")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 32 decode tokens, 1 repeat")
    ap.add_argument("--serve", action="store_true", help="then run bench/serve_peer.py")
    ap.add_argument("--serve-args", default="", help="extra arguments for bench/serve_peer.py")
    ap.add_argument("--interference", action="store_true", help="then run bench/interference.py")
    ap.add_argument("--out", help="write the run as JSON here")
    a = ap.parse_args()
    if a.threads < 1 or a.rounds < 1:
        ap.error("--threads and --rounds must be >= 1")
    if a.quick:
        a.requests, a.decode_tokens, a.repeats = 8, 32, 1
    engines = [e for e in a.engines.split(",") if e]
    if set(engines) - {"tandem", "vllm"}:
        ap.error(f"--engines takes tandem and/or vllm, got {a.engines!r}")
    if "vllm" in engines and not (a.vllm_python and os.path.exists(a.vllm_python)):
        ap.error("the vllm engine needs --vllm-python pointing at an interpreter with vllm-cpu")
    model = a.model or tempfile.mkdtemp(prefix="peer-vllm-")
    if a.model is None:
        build_model(model)
    work = workload(a.requests, a.seed)
    work_file = os.path.join(tempfile.mkdtemp(prefix="peer-vllm-work-"), "work.json")
    with open(work_file, "w") as f:
        json.dump(work, f)
    torch.set_num_threads(a.threads)
    bind = {"all": f"0-{a.threads - 1}"}.get(a.vllm_bind, a.vllm_bind)
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(a.threads), "VLLM_CPU_OMP_THREADS_BIND": bind,
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    bw, rd = [memcpy_gbps()], [read_gbps()]
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for rnd in range(a.rounds):  # alternate the order: a VM's speed drifts over minutes
        for name in engines if rnd % 2 == 0 else engines[::-1]:
            python = sys.executable if name == "tandem" else a.vllm_python
            print(f"[{name}] round {rnd + 1}/{a.rounds} running ...", flush=True)
            before = read_gbps()
            run = run_engine(name, python, model, work_file, env, a.decode_tokens, a.repeats)
            run["read_gbps"] = max(before, read_gbps())  # the round's own limit: see the module doc
            rd.append(run["read_gbps"])
            runs[name].append(run)
    results = {name: median_run(rs) for name, rs in runs.items()}
    bw.append(memcpy_gbps())
    rd.append(read_gbps())
    gbps, rgbps, wbytes = max(bw), max(rd), decode_weight_bytes(model)
    limit = rgbps * 1e9 / wbytes
    out_tokens = sum(o for _, o in work)
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "loadavg": os.getloadavg()},
              "versions": versions(a.vllm_python), "threads": a.threads, "vllm_bind": bind,
              "command": shlex.join([sys.executable, "-m", "bench.peer_vllm", *sys.argv[1:]]),
              "memcpy_gbps": gbps, "read_gbps": rgbps, "decode_weight_mb": wbytes / 1e6,
              "b1_limit_tok_s": limit, "engines": {}}
    print(f"\nthreads={a.threads} vllm bind={bind} memcpy={gbps:.1f} GB/s read={min(rd):.1f}-{rgbps:.1f} GB/s; "
          f"a decode step reads {wbytes / 1e6:.0f} MB of weights -> batch-1 limit up to {limit:.0f} tok/s "
          f"(each round against its own); load {os.getloadavg()[0]:.2f}")
    print(f"{'engine':8} {'offline tok/s':>14} {'b1 decode tok/s':>16} {'of limit':>9}  info")
    for name, r in results.items():
        tps = out_tokens / r["offline_s"]
        of_limit = [x["b1_tok_s"] * wbytes / (x["read_gbps"] * 1e9) for x in runs[name]]
        report["engines"][name] = {"offline_tok_s": tps, "b1_tok_s": r["b1_tok_s"], "info": r["info"],
                                   "b1_of_limit": statistics.median(of_limit),
                                   "rounds_offline_tok_s": [out_tokens / x["offline_s"] for x in runs[name]],
                                   "rounds_b1_tok_s": [x["b1_tok_s"] for x in runs[name]],
                                   "rounds_read_gbps": [x["read_gbps"] for x in runs[name]]}
        print(f"{name:8} {tps:14.1f} {r['b1_tok_s']:16.1f} {statistics.median(of_limit):9.0%}  {r['info']}")
        if a.rounds > 1:
            offline = " ".join(f"{out_tokens / x['offline_s']:.1f}" for x in runs[name])
            b1 = " ".join(f"{x['b1_tok_s']:.1f} ({f:.0%} of {x['read_gbps']:.1f} GB/s)"
                          for x, f in zip(runs[name], of_limit))
            print(f"{'':8} rounds: offline {offline}; b1 {b1}")
    if len(results) == 2:
        t, v = results["tandem"], results["vllm"]
        agree = [i for i, (x, y) in enumerate(zip(t["tokens"], v["tokens"])) if x == y]
        firsts = [next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
                  for x, y in zip(t["tokens"], v["tokens"])]
        report["offline_ratio"] = v["offline_s"] / t["offline_s"]
        report["b1_ratio"] = t["b1_tok_s"] / v["b1_tok_s"]
        report["greedy_agree"] = len(agree)
        report["first_divergence"] = [f for f in firsts if f is not None]
        # the diverging requests themselves, to check each engine against transformers
        report["diverging"] = [{"request": i, "prompt": work[i][0], "tandem": t["tokens"][i], "vllm": v["tokens"][i],
                                "first": f} for i, f in enumerate(firsts) if f is not None]
        print(f"tandem / vLLM: offline {report['offline_ratio']:.2f}x, batch-1 decode {report['b1_ratio']:.2f}x; "
              f"greedy tokens agree on {len(agree)}/{len(work)} requests"
              + (f" (others diverge at output token {report['first_divergence']})" if len(agree) < len(work) else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    rc = 0
    if a.serve:
        serve = ["--vllm-python", a.vllm_python or "", "--model", model, *shlex.split(a.serve_args)]
        rc |= passthrough("bench.serve_peer", serve + (["--rates", "2", "--num-prompts", "8"] if a.quick else []))
    if a.interference:
        rc |= passthrough("bench.interference", ["--model", model] + (["--quick"] if a.quick else []))
    sys.exit(rc)


if __name__ == "__main__":
    main()
