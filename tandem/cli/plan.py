"""`tandem plan`: from a profile and a workload, predict every P:D split's TTFT/ITL and goodput.

Prints one row per split of --workers (and colocated), marks the best (most requests/s within both
SLOs); --min-workers-for-rate finds the smallest cluster meeting the SLOs at --rate instead;
--emit-kustomize DIR writes the pick as replica counts for Deployments tandem-prefill / tandem-decode.
Bad input (a profile of another model, a malformed workload, SLOs no split meets) exits 2, one line.
"""

from __future__ import annotations

import argparse
import os
import time

from tandem.planner import workload as workloads
from tandem.planner.planner import Outcome, Slo, best, meets, min_workers, plan
from tandem.planner.profile import CostModel, Profile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate P:D splits on a profile and a workload; pick the best",
                       description=__doc__.split("\n\n")[0] + " See docs/PLANNING.md.")
    p.add_argument("--profile", required=True, help="JSON written by `tandem profile`")
    p.add_argument("--workload", required=True,
                   help=f"a JSONL trace of {{arrival_s, prompt_tokens, output_tokens}}, a preset "
                        f"({', '.join(workloads.PRESETS)}) or prompt=DIST,output=DIST with DIST one of N, "
                        "uniform:A:B, normal:MEAN:STD, exp:MEAN")
    p.add_argument("--rate", type=float, default=None,
                   help="offered load, requests/s (Poisson); a trace without it keeps its own arrival times")
    p.add_argument("--arrivals", choices=["poisson", "uniform"], default="poisson", help="arrival process at --rate")
    p.add_argument("--ttft-slo", type=float, required=True, help="time-to-first-token target, seconds")
    p.add_argument("--itl-slo", type=float, required=True, help="mean inter-token latency target, seconds")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs for a split to meet them (default 0.9)")
    p.add_argument("--workers", type=int, default=None, help="cluster size N: simulate every P:D split of N")
    p.add_argument("--min-workers-for-rate", action="store_true",
                   help="instead: the smallest N whose best split meets the SLOs at --rate")
    p.add_argument("--max-workers", type=int, default=1024, help="search limit for --min-workers-for-rate")
    p.add_argument("--requests", type=int, default=10_000, help="requests to simulate (default 10000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-prefill-threshold", type=int, default=32,
                   help="decode workers prefill prompts shorter than this themselves (as `tandem decode`)")
    p.add_argument("--local-prefill-if-busy", type=int, default=0,
                   help="the router's conditional disaggregation, as given to `tandem router` (default 0: off)")
    p.add_argument("--model", default=None, help="refuse the profile unless it was measured for this checkpoint")
    p.add_argument("--emit-kustomize", metavar="DIR", default=None,
                   help="write a kustomize overlay with the pick's replica counts into DIR")
    p.add_argument("--kustomize-base", default="../base",
                   help="the overlay's resources entry, relative to DIR (default ../base); an absolute path is "
                        "written relative to DIR, e.g. $PWD/deploy/k8s/overlays/gpu")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    profile = Profile.load(args.profile)
    profile.check_matches(args.model)
    slo = Slo(args.ttft_slo, args.itl_slo, args.attainment)
    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    wl = workloads.load(args.workload, args.requests, args.rate, args.seed, args.arrivals)
    wl.check_fits(profile.model.max_model_len)
    cost = CostModel(profile)
    print(f"profile: {profile.model.path} (config {profile.model.config_hash}), {profile.engine.dtype}, "
          f"{profile.engine.threads} thread(s)/worker, budget {profile.engine.max_num_batched_tokens} tokens, "
          f"{profile.engine.max_num_seqs} seats, kv {profile.kv_transfer.get('connector')}")
    print(f"workload: {wl.description}; {len(wl)} requests, {wl.rate:.3g} req/s offered")
    print(f"SLOs: TTFT <= {slo.ttft_s:g} s, ITL <= {slo.itl_s:g} s, for {slo.attainment:.0%} of requests")
    t0 = time.perf_counter()
    if args.min_workers_for_rate:
        found = min_workers(cost, wl, slo, args.max_workers, args.local_prefill_threshold,
                            args.local_prefill_if_busy)
        if found is None:
            raise ValueError(f"no cluster of up to {args.max_workers} workers meets the SLOs at "
                             f"{wl.rate:.3g} req/s (raise --max-workers, or relax the SLOs)")
        n, pick = found
        print_table([pick], pick)
        print(f"smallest cluster: {n} workers, {pick.split} ({time.perf_counter() - t0:.1f} s to search)")
    else:
        if args.workers is None:
            raise ValueError("give --workers N (or --min-workers-for-rate)")
        outcomes = plan(cost, wl, slo, args.workers, args.local_prefill_threshold,
                        local_if_busy=args.local_prefill_if_busy)
        pick = best(outcomes)
        print_table(outcomes, pick)
        print(f"simulated {len(outcomes)} splits x {len(wl)} requests in {time.perf_counter() - t0:.1f} s")
        if not meets(pick, slo):
            raise ValueError(f"no split of {args.workers} workers meets both SLOs for {slo.attainment:.0%} of "
                             f"requests at {wl.rate:.3g} req/s (best: {pick.split}, {pick.attainment:.0%}); "
                             "add workers or relax the SLOs")
        print(f"best: {pick.split}")
    if args.emit_kustomize:
        path = emit_kustomize(args.emit_kustomize, pick, args.kustomize_base)
        print(f"wrote {path}")
    return 0


def print_table(outcomes: list[Outcome], pick: Outcome) -> None:
    print(f"  {'split':<14} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} {'in SLO':>7} "
          f"{'goodput':>9} {'/worker':>8}")
    for o in outcomes:
        mark = "*" if o is pick else " "
        print(f"{mark} {str(o.split):<14} {ms(o.ttft_p50)} {ms(o.ttft_p99)} {ms(o.itl_p50)} {ms(o.itl_p99)} "
              f"{o.attainment:>7.1%} {o.goodput:>9.3g} {o.per_worker:>8.3g}")
    print("  (times in ms; goodput in requests/s within both SLOs)")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:>9.1f}"


def emit_kustomize(directory: str, pick: Outcome, base: str) -> str:
    """A kustomize overlay: a strategic-merge patch setting the two Deployments' replicas. Colocated
    means no prefill workers: decode replicas N, prefill 0 (their pods must run `--kv-connector none`)."""
    os.makedirs(directory, exist_ok=True)
    if os.path.isabs(base):  # kustomize refuses absolute resource paths ("cannot be absolute")
        base = os.path.relpath(base, os.path.abspath(directory))
    prefill = 0 if pick.split.colocated else pick.split.prefill
    patch = "".join(f"---\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {name}\nspec:\n  replicas: {n}\n"
                    for name, n in (("tandem-prefill", prefill), ("tandem-decode", pick.split.decode)))
    with open(os.path.join(directory, "tandem-pd-replicas.yaml"), "w", encoding="utf-8") as f:
        f.write(f"# written by `tandem plan`: {pick.split}, {pick.goodput:.3g} req/s predicted goodput\n{patch}")
    kustomization = os.path.join(directory, "kustomization.yaml")
    with open(kustomization, "w", encoding="utf-8") as f:
        f.write(f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {base}\n"
                "patches:\n  - path: tandem-pd-replicas.yaml\n")
    return kustomization
