"""The planner: simulate P:D splits of N workers (and colocated) on a workload, rank them by goodput.

Goodput is requests per second that met both SLOs (TTFT, and ITL as the request's mean gap after its
first token, as the router judges them in router_svc/slo.py). A split "meets" the SLOs when at least
`attainment` of its requests do. `plan` simulates every split (or, past `FULL_SEARCH_MAX` workers, a
coarse grid and then every split around the best of it); `min_workers` searches the smallest N whose
best split meets the SLOs at the workload's rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.planner.profile import CostModel
from tandem.planner.simulator import SimResult, Simulator
from tandem.planner.workload import Workload

FULL_SEARCH_MAX = 64  # past this many workers, search splits coarse-to-fine instead of all of them


@dataclass(slots=True, frozen=True)
class Split:
    prefill: int
    decode: int
    colocated: bool = False

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"colocated x{self.decode}" if self.colocated else f"{self.prefill}P:{self.decode}D"


@dataclass(slots=True)
class Outcome:
    split: Split
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    attainment: float  # share of requests within both SLOs
    goodput: float  # requests/s within both SLOs
    sim_wall_s: float

    @property
    def per_worker(self) -> float:
        return self.goodput / self.split.workers


@dataclass(slots=True)
class Slo:
    ttft_s: float
    itl_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name, v in (("--ttft-slo", self.ttft_s), ("--itl-slo", self.itl_s)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {v}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(split: Split, res: SimResult, slo: Slo) -> Outcome:
    itls = [x for x in res.itl_s if x is not None] or [0.0]
    met = res.met(slo.ttft_s, slo.itl_s)
    n = len(res.ttft_s)
    # Goodput over the arrival span: a split that keeps up serves the offered rate times its attainment.
    rate = (n - 1) / res.duration_s if res.duration_s > 0 else float(n)
    return Outcome(split, percentile(res.ttft_s, 50), percentile(res.ttft_s, 99), percentile(itls, 50),
                   percentile(itls, 99), met / n, rate * met / n, res.wall_s)


def simulate(cost: CostModel, split: Split, wl: Workload, slo: Slo, local_prefill_threshold: int = 32,
             core_of: list[int] | None = None, local_if_busy: int = 0) -> Outcome:
    sim = Simulator(cost, split.prefill, split.decode, split.colocated, local_prefill_threshold, core_of,
                    local_if_busy)
    return summarise(split, sim.run(wl), slo)


def splits_to_try(n: int, full_search_max: int = FULL_SEARCH_MAX) -> list[int]:
    """Prefill counts to simulate first: all of 1..n-1, or a grid of about 16 past full_search_max."""
    if n - 1 <= full_search_max:
        return list(range(1, n))
    step = max(1, (n - 1) // 16)
    return sorted(set(range(1, n, step)) | {n - 1})


def plan(cost: CostModel, wl: Workload, slo: Slo, workers: int, local_prefill_threshold: int = 32,
         full_search_max: int = FULL_SEARCH_MAX, local_if_busy: int = 0) -> list[Outcome]:
    """Outcomes for the splits of `workers` and colocated, in split order (colocated last)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    done: dict[int, Outcome] = {}
    for p in splits_to_try(workers, full_search_max):
        done[p] = simulate(cost, Split(p, workers - p), wl, slo, local_prefill_threshold,
                           local_if_busy=local_if_busy)
    if workers - 1 > full_search_max:  # refine: every split between the best grid point's neighbours
        best = max(done.values(), key=rank).split.prefill
        step = max(1, (workers - 1) // 16)
        for p in range(max(1, best - step + 1), min(workers - 1, best + step - 1) + 1):
            if p not in done:
                done[p] = simulate(cost, Split(p, workers - p), wl, slo, local_prefill_threshold,
                                   local_if_busy=local_if_busy)
    outcomes = [done[p] for p in sorted(done)]
    outcomes.append(simulate(cost, Split(0, workers, colocated=True), wl, slo))
    return outcomes


def rank(o: Outcome) -> tuple[float, float, float]:
    """Most goodput first; then the higher attainment; then the lower TTFT p99."""
    return o.goodput, o.attainment, -o.ttft_p99


def best(outcomes: list[Outcome]) -> Outcome:
    return max(outcomes, key=rank)


def meets(o: Outcome, slo: Slo) -> bool:
    return o.attainment >= slo.attainment


def min_workers(cost: CostModel, wl: Workload, slo: Slo, max_workers: int,
                local_prefill_threshold: int = 32, local_if_busy: int = 0) -> tuple[int, Outcome] | None:
    """Smallest N (and its best split) meeting the SLOs at the workload's rate; None up to max_workers.
    Doubling, then bisection: more workers never serve the same load worse, to the simulator's noise."""
    cache: dict[int, Outcome | None] = {}

    def ok(n: int) -> Outcome | None:
        if n not in cache:
            # Coarse-to-fine over splits: a search simulates many cluster sizes.
            o = best(plan(cost, wl, slo, n, local_prefill_threshold, 16, local_if_busy))
            cache[n] = o if meets(o, slo) else None
        return cache[n]

    hi = 1
    while not ok(hi):
        if hi >= max_workers:
            return None
        hi = min(hi * 2, max_workers)
    lo = hi // 2  # fails (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    found = ok(hi)
    assert found is not None
    return hi, found
