"""CPU cores shared out, not fought over: the plan for co-located workers and how a worker applies it.

Two torch processes that both use every core stall each other in OpenMP barriers (spinning threads
wait for a thread the other process preempted), for seconds at a time. So:
- the **budget** is the cores this process may run on (its affinity mask), capped by a container's
  CPU quota (compose `cpus:`, a Kubernetes CPU limit) and by an exported `OMP_NUM_THREADS`: on a
  shared machine that variable is the share the user gave *all* of tandem, not a per-worker count;
- `plan()` gives each co-located worker a disjoint slice of the budget (decode workers get the
  remainder: their steps are latency-bound), or `per_worker` cores each when asked; with more
  workers than cores they share cores within their role only (prefill never time-slices with decode);
- a worker started with `--cpus` pins itself to its slice (`apply()`: `sched_setaffinity` and
  `torch.set_num_threads(len(slice))`); one started without takes what its affinity mask allows.

`--cpus` takes a cpuset ("0-3,8") or a share "i/n": slice i of n of the worker's own affinity mask,
for hosts whose core count the launcher does not know (`tandem launch` over ssh). "i/n:p" says the
first p of the host's n workers are prefill workers: with more workers than cores the share is then
`tandem up`'s role-grouped plan, and the worker knows where to move on a role switch (`switch_share`).
"""

from __future__ import annotations

import os
import re
from typing import Mapping


def available() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cgroup_cpu_limit(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """Whole cores of a container's CPU quota (cgroup v2 `cpu.max`: "QUOTA PERIOD" or "max PERIOD"),
    rounded up; None without a quota. Compose `cpus:` and Kubernetes CPU limits set it: the affinity
    mask still shows every core of the host, but only this many can run at once."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, -(-int(quota) // int(period)))


def budget(env: Mapping[str, str]) -> list[int]:
    """The cores tandem may use here: the affinity mask, capped by a container's CPU quota and by an
    exported OMP_NUM_THREADS."""
    cores = available()
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = cores[:limit]
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        if not omp.isdigit() or int(omp) < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp!r} is not a positive integer")
        cores = cores[:int(omp)]
    return cores


def format_cpuset(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpuset(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8]; ValueError naming what is wrong."""
    if not text.strip():
        raise ValueError(f"cpuset {text!r} is empty")
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"cpuset {text!r}: {part!r} is not a core number or a range like 0-3")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"cpuset {text!r}: the range {part!r} is empty")
        cores.update(range(lo, hi + 1))
    if not cores:
        raise ValueError(f"cpuset {text!r} is empty")
    return sorted(cores)


_SHARE = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*(?::\s*(\d+)\s*)?")


def resolve(spec: str, allowed: list[int] | None = None) -> list[int]:
    """A worker's `--cpus` value (cpuset, share "i/n" or "i/n:p") -> its cores, all within `allowed`."""
    share = _SHARE.fullmatch(spec)
    if allowed is None:  # a share divides the budget; a cpuset must lie within the mask
        allowed = budget(os.environ) if share else available()
    if share:
        plan_, name = _share_plan(spec, share, allowed)
        return plan_[name]
    cores = parse_cpuset(spec)
    outside = [c for c in cores if c not in allowed]
    if outside:
        raise ValueError(f"--cpus {spec}: cores {format_cpuset(outside)} are not available to this process "
                         f"(its affinity mask allows {format_cpuset(allowed)})")
    return cores


def switch_share(spec: str, allowed: list[int] | None = None) -> list[int] | None:
    """For a share "i/n:p" whose host has more workers than cores, the core to move to on a role switch
    (as `tandem up` passes --switch-cpus); None where the worker keeps its cores."""
    share = _SHARE.fullmatch(spec)
    if not share or share.group(3) is None:
        return None
    plan_, name = _share_plan(spec, share, budget(os.environ) if allowed is None else allowed)
    return switch_targets(plan_).get(name)


def _share_plan(spec: str, share: re.Match, allowed: list[int]) -> tuple[dict[str, list[int]], str]:
    """The host's plan a share stands for, and this worker's name in it."""
    i, n = int(share.group(1)), int(share.group(2))
    if not 0 <= i < n:
        raise ValueError(f"--cpus {spec}: a share is i/n with 0 <= i < n")
    p = n if share.group(3) is None else int(share.group(3))
    if p > n:
        raise ValueError(f"--cpus {spec}: i/n:p names p of the host's n workers as prefill, so p <= n")
    names = [f"prefill-{k}" for k in range(p)] + [f"decode-{k}" for k in range(n - p)]
    if n > len(allowed) and share.group(3) is None:  # roles unknown: one core each, round-robin
        return {name: [allowed[k % len(allowed)]] for k, name in enumerate(names)}, names[i]
    return plan(names, allowed), names[i]


def slices(cores: list[int], n: int) -> list[list[int]]:
    """`cores` cut into n contiguous slices; the last ones get the remainder."""
    base, extra = divmod(len(cores), n)
    sizes = [base + (1 if i >= n - extra else 0) for i in range(n)]
    out, start = [], 0
    for size in sizes:
        out.append(cores[start:start + size])
        start += size
    return out


def plan(names: list[str], cores: list[int], per_worker: int | None = None) -> dict[str, list[int]]:
    """Disjoint cores for each worker (in the order given; decode workers last get any remainder).
    With more workers than cores they must share: one core each, cores split between the roles
    ("prefill-0" -> prefill), round-robin within a role."""
    if per_worker is not None:
        if per_worker < 1:
            raise ValueError(f"--cpus-per-worker must be >= 1, got {per_worker}")
        need = per_worker * len(names)
        if need > len(cores):
            raise ValueError(f"--cpus-per-worker {per_worker} x {len(names)} workers needs {need} cores, but only "
                             f"{len(cores)} are available (cpus {format_cpuset(cores)}; an exported "
                             "OMP_NUM_THREADS also caps it)")
        return {name: cores[i * per_worker:(i + 1) * per_worker] for i, name in enumerate(names)}
    if len(names) > len(cores):
        return _shared_plan(names, cores)
    return dict(zip(names, slices(cores, len(names))))


def _role(name: str) -> str:
    return name.rsplit("-", 1)[0]  # "prefill-0" -> "prefill"


def _shared_plan(names: list[str], cores: list[int]) -> dict[str, list[int]]:
    """More workers than cores: one core each, and a core is only shared within a role. Each role gets
    cores in proportion to its workers (at least one): a prefill worker time-slicing with a decode
    worker would bring back the interference disaggregation removes — measured on 2 cores, 1 prefill
    and 2 decode workers, prompt-heavy load: prefill paired with a decode worker met the SLOs for 23%
    of requests (docs/PLANNING.md)."""
    roles: dict[str, list[str]] = {}
    for name in names:
        roles.setdefault(_role(name), []).append(name)
    if len(roles) == 1 or len(cores) < len(roles):
        return {name: [cores[i % len(cores)]] for i, name in enumerate(names)}
    counts = {role: len(members) for role, members in roles.items()}
    share = {role: 1 for role in roles}  # then the rest one at a time to the role with most workers per core
    for _ in range(len(cores) - len(roles)):
        role = max(roles, key=lambda r: counts[r] / share[r])
        share[role] += 1
    out, start = {}, 0
    for role, members in roles.items():
        mine = cores[start:start + share[role]]
        start += share[role]
        out.update(plan(members, mine))
    return out


def assign(names: list[str], budget: list[int], per_worker: int | None = None) -> tuple[dict[str, list[int]], bool]:
    """`tandem up`'s plan: with a core to spare (and no --cpus-per-worker), the workers leave the last one
    to the router, its clients and the OS: a worker whose OpenMP team shares a core with them waits in
    barriers whenever they run. Returns the plan and whether a core was spared."""
    spare = per_worker is None and len(budget) > len(names)
    return plan(names, budget[:-1] if spare else budget, per_worker), spare


def switch_targets(assignment: dict[str, list[int]]) -> dict[str, list[int]]:
    """Where shared cores keep the roles apart (`_shared_plan`), the core each worker moves to if it is
    switched to the other role: that role's core with the fewest workers, so a role switch does not put
    a prefill and a decode worker on one core. {} where every worker has cores of its own (a switched
    worker keeps them: nobody else is on them) or the plan has one role."""
    users: dict[int, int] = {}
    for cores in assignment.values():
        for c in cores:
            users[c] = users.get(c, 0) + 1
    if all(users[c] == 1 for c in users):
        return {}
    by_role: dict[str, set[int]] = {}
    for name, cores in assignment.items():
        by_role.setdefault(_role(name), set()).update(cores)
    if len(by_role) != 2:
        return {}
    out = {}
    for name in assignment:
        other = next(cores for role, cores in by_role.items() if role != _role(name))
        out[name] = [min(sorted(other), key=lambda c: users[c])]
    return out


def describe(assignment: dict[str, list[int]]) -> str:
    return ", ".join(f"{name} cpus {format_cpuset(c)} ({len(c)} thread{'s' * (len(c) != 1)})"
                     for name, c in assignment.items())


def apply(spec: str | None) -> list[int]:
    """Pin this process to its cores and size torch's thread pool to match; returns the cores."""
    if spec is None:
        return pin(budget(os.environ), set_mask=False)
    return pin(resolve(spec))


def pin(cores: list[int], set_mask: bool = True) -> list[int]:
    import torch

    if set_mask:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores
