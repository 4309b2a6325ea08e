"""Goodput of a real `tandem up` P:D split under open-loop Poisson load, beside the simulator's prediction.

    python -m bench.goodput (--prefill P --decode D | --colocated --decode N) --workload prompt-heavy \
        --rate 2 --duration 60 --ttft-slo 1 --itl-slo 0.05 [--profile profile.json] [--model DIR] [--out F]

Starts `tandem up` with that split (its cpu plan pins every worker to its own cores, one thread each
when there are more workers than cores: docs/CPUS.md), waits for /health, warms up, then sends the
workload's requests at their Poisson arrival times through the streaming OpenAI HTTP API
(bench/stream_client.py: token-id prompts of the workload's lengths, `ignore_eos`, exact
`max_tokens`). Reports TTFT/ITL p50/p99 and goodput (requests/s within both SLOs; a failed request
misses), judged exactly as `tandem plan` judges simulated ones, and with --profile the simulator's
prediction for the same requests and arrival times. The machine should be otherwise idle: the client
and the router share its cores with the workers.

Two predictions: "simulated" takes every worker to have its own hardware (what `tandem plan` assumes);
"sim shared" also knows which workers `tandem up`'s cpu plan puts on one core (more workers than
cores: round-robin) and shares each such core among its busy workers (tandem/planner/simulator.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.serve_peer import machine_info  # noqa: E402
from bench.servers import Server, free_port, warm_up  # noqa: E402
from bench.stream_client import Sent, run_load  # noqa: E402
from tandem.cli import cpus  # noqa: E402
from tandem.planner import workload as workloads  # noqa: E402
from tandem.planner.planner import Outcome, Slo, Split, simulate, summarise  # noqa: E402
from tandem.planner.profile import CostModel, Profile  # noqa: E402
from tandem.planner.simulator import SimResult  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--colocated", action="store_true", help="--decode N colocated workers, no prefill workers")
    p.add_argument("--workload", default="balanced", help="as `tandem plan --workload` (preset, spec or JSONL trace)")
    p.add_argument("--rate", type=float, required=True, help="requests/s, Poisson")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (requests = rate x duration)")
    p.add_argument("--ttft-slo", type=float, required=True)
    p.add_argument("--itl-slo", type=float, required=True)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--profile", default=None, help="a `tandem profile` JSON: print the simulator's prediction too")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", default="",
                   help="more `tandem up` flags, one string (starting with --: write --extra=--rebalance)")
    p.add_argument("--window", type=float, default=0.0,
                   help="also print goodput per window of this many seconds of arrivals (to watch --rebalance act)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def server_command(a: argparse.Namespace, model: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--model", model, "--host", "127.0.0.1", "--http-port",
           str(port), "--grpc-port", "0", "--decode", str(a.decode), "--served-model-name", "bench",
           "--ttft-slo", str(a.ttft_slo), "--itl-slo", str(a.itl_slo)]
    cmd += ["--colocated"] if a.colocated else ["--prefill", str(a.prefill)]
    return cmd + a.extra.split()


def shared_cores(split: Split) -> list[int] | None:
    """Per worker (prefill first, then decode: tandem up's order), the core it shares with others, or -1
    when its cores are its own; None when no worker shares."""
    names = [f"prefill-{i}" for i in range(split.prefill)] + [f"decode-{i}" for i in range(split.decode)]
    assignment, _ = cpus.assign(names, cpus.budget(os.environ))
    groups = [tuple(assignment[n]) for n in names]
    core_of = [g[0] if groups.count(g) > 1 else -1 for g in groups]
    return core_of if any(c >= 0 for c in core_of) else None


def tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of `root` and its descendants, by kind: "workers" (`tandem
    prefill` / `tandem decode`) and "host" (the `tandem up` supervisor and the router)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        procs[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, argv)  # ppid, cpu
    out, todo = {"workers": 0.0, "host": 0.0}, [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            _, cpu, argv = procs[pid]
            module = next((m for m in (b"tandem.cli", b"tandem.cli.up") if m in argv[:-1]), None)
            role = argv[argv.index(module) + 1] if module else b""  # tandem up runs `-m tandem.cli.up ROLE`
            out["workers" if role in (b"prefill", b"decode") else "host"] += cpu
        todo += [child for child, (ppid, _, _) in procs.items() if ppid == pid]
    return out


def client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured_outcome(split: Split, results, wl: workloads.Workload, slo: Slo) -> tuple[Outcome, int]:
    """The run judged as the planner judges a simulation; a failed request counts as a miss."""
    inf = float("inf")
    ok = [r.error is None and r.ttft_s is not None for r in results]
    ttft = [r.ttft_s if good else inf for r, good in zip(results, ok)]
    itl = [r.itl_s if good else inf for r, good in zip(results, ok)]  # None: a one-token answer
    failed = ok.count(False)
    return summarise(split, SimResult(ttft, itl, wl.duration_s, 0.0, 0), slo), failed


def windowed(results, wl: workloads.Workload, slo: Slo, window: float) -> list[dict]:
    """Goodput per window of arrival time: requests that arrived in it and met both SLOs, per second."""
    out: list[dict] = []
    for r, t in zip(results, wl.arrival_s):
        k = int(t // window)
        while len(out) <= k:
            out.append({"from_s": len(out) * window, "requests": 0, "met": 0})
        out[k]["requests"] += 1
        good = r.error is None and r.ttft_s is not None and r.ttft_s <= slo.ttft_s and (
            r.itl_s is None or r.itl_s <= slo.itl_s)
        out[k]["met"] += good
    for w in out:
        w["goodput"] = w["met"] / window
    return out


def row(name: str, o: Outcome) -> str:
    return (f"{name:<10} {o.ttft_p50 * 1e3:>9.1f} {o.ttft_p99 * 1e3:>9.1f} {o.itl_p50 * 1e3:>8.2f} "
            f"{o.itl_p99 * 1e3:>8.2f} {o.attainment:>7.1%} {o.goodput:>8.3f}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from tandem.default_model import default_model_path

    model = a.model or default_model_path()
    split = Split(0, a.decode, True) if a.colocated else Split(a.prefill, a.decode)
    slo = Slo(a.ttft_slo, a.itl_slo, a.attainment)
    wl = workloads.load(a.workload, max(2, round(a.rate * a.duration)), a.rate, a.seed)
    profile = Profile.load(a.profile) if a.profile else None
    if profile is not None:
        profile.check_matches(model)
        wl.check_fits(profile.model.max_model_len)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    rng = random.Random(a.seed)
    sent = [Sent(t, [rng.randrange(3, vocab) for _ in range(p)], o)
            for t, p, o in zip(wl.arrival_s, wl.prompt_tokens, wl.output_tokens)]

    port = free_port()
    log = Path(f"/tmp/tandem-goodput-{os.getpid()}.log")
    server = Server(f"tandem {split}", server_command(a, model, port), dict(os.environ), port, log)
    load_before = os.getloadavg()
    try:
        print(f"ready in {server.wait_ready(300):.0f} s; warming up", flush=True)
        warm_up(server.base, "bench", 128, n=2 * split.workers)
        print(f"{len(sent)} requests over {wl.duration_s:.0f} s ({wl.description})", flush=True)
        t0, cpu0, client0 = time.monotonic(), tree_cpu_s(server.proc.pid), client_cpu_s()
        results = run_load(server.base, "bench", sent, timeout_s=max(120.0, 4 * a.duration))
        wall = time.monotonic() - t0
        cpu1, client1 = tree_cpu_s(server.proc.pid), client_cpu_s()
    finally:
        server.stop()
    measured, failed = measured_outcome(split, results, wl, slo)
    predicted = shared = None
    if profile is not None:
        predicted = simulate(CostModel(profile), split, wl, slo)
        core_of = shared_cores(split)
        shared = simulate(CostModel(profile), split, wl, slo, core_of=core_of) if core_of else predicted

    print(f"\n{split}: {len(results)} requests, {failed} failed, {wall:.0f} s; load average "
          f"{load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    tokens = sum(r.tokens for r in results if r.error is None)
    cpu = {"workers_s": cpu1["workers"] - cpu0["workers"], "router_s": cpu1["host"] - cpu0["host"],
           "client_s": client1 - client0, "wall_s": wall, "tokens": tokens}
    print(f"cpu during the load: workers {cpu['workers_s']:.1f} s, router + supervisor {cpu['router_s']:.1f} s, "
          f"client {cpu['client_s']:.1f} s over {wall:.0f} s; router + client "
          f"{(cpu['router_s'] + cpu['client_s']) / max(tokens, 1) * 1e6:.0f} us per streamed token")
    print(f"SLOs: TTFT <= {a.ttft_slo:g} s, ITL <= {a.itl_slo:g} s")
    print(f"{'':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'in SLO':>7} {'goodput':>8}")
    print(row("measured", measured))
    if predicted is not None and shared is not None:
        print(row("simulated", predicted))
        print(row("sim shared", shared))
        for name, o in (("simulated", predicted), ("sim shared", shared)):
            err = (o.goodput - measured.goodput) / measured.goodput if measured.goodput else float("inf")
            print(f"goodput prediction error ({name}): {err:+.1%}")
    windows = windowed(results, wl, slo, a.window) if a.window > 0 else []
    for w in windows:
        print(f"  arrivals {w['from_s']:>5.0f}-{w['from_s'] + a.window:<5.0f} s: {w['met']:>4}/{w['requests']:<4} "
              f"in SLO, goodput {w['goodput']:.3f}")
    errors = sorted({r.error for r in results if r.error})[:3]
    if errors:
        print("errors:", "; ".join(errors))
    if a.out:
        record = {"split": str(split), "workload": wl.description, "rate": a.rate, "duration_s": a.duration,
                  "requests": len(results), "failed": failed, "slo": {"ttft_s": a.ttft_slo, "itl_s": a.itl_slo},
                  "measured": outcome_dict(measured), "predicted": outcome_dict(predicted) if predicted else None,
                  "predicted_shared_cores": outcome_dict(shared) if shared else None,
                  "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "profile": a.profile, "windows": windows, "cpu": cpu}
        Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


def outcome_dict(o: Outcome) -> dict:
    return {k: getattr(o, k) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "attainment", "goodput")}


if __name__ == "__main__":
    sys.exit(main())
