"""Workloads for the simulator: requests as (arrival_s, prompt_tokens, output_tokens).

A workload is either a length spec — `prompt=DIST,output=DIST` with DIST one of `N` (fixed),
`uniform:A:B`, `normal:MEAN:STD`, `exp:MEAN`, or a preset name (`PRESETS`) — with Poisson (or evenly
spaced) arrivals at a rate, or a JSONL trace of `{"arrival_s", "prompt_tokens", "output_tokens"}`,
replayed at its own arrival times or, given a rate, re-timed as Poisson with the trace's lengths.
Bad input is a ValueError naming the line or the field.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

# Prompt-heavy: long prompts, short answers (summarising); decode-heavy: short prompts, long answers.
PRESETS = {
    "prompt-heavy": "prompt=uniform:384:768,output=uniform:16:48",
    "decode-heavy": "prompt=uniform:32:96,output=uniform:128:256",
    "balanced": "prompt=uniform:128:384,output=uniform:64:160",
}


@dataclass(slots=True)
class Workload:
    arrival_s: list[float]  # non-decreasing
    prompt_tokens: list[int]
    output_tokens: list[int]
    description: str

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return self.arrival_s[-1] - self.arrival_s[0] if self.arrival_s else 0.0

    @property
    def rate(self) -> float:
        """Offered load: requests per second over the arrival span."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else float("inf")

    def check_fits(self, max_model_len: int) -> None:
        longest = max(p + o for p, o in zip(self.prompt_tokens, self.output_tokens))
        if longest > max_model_len:
            raise ValueError(f"the workload has a request of {longest} tokens (prompt + output), over the "
                             f"profiled max_model_len {max_model_len}")


class LengthDist:
    """One token-length distribution, parsed from `N`, `uniform:A:B`, `normal:MEAN:STD` or `exp:MEAN`."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        kind, *args = spec.split(":")
        try:
            nums = [float(a) for a in args] if args else [float(kind)]
        except ValueError:
            raise ValueError(f"bad length distribution {spec!r}: numbers expected "
                             "(N | uniform:A:B | normal:MEAN:STD | exp:MEAN)") from None
        self.kind = "fixed" if not args else kind
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "exp": 1}
        if self.kind not in arity or len(nums) != arity[self.kind]:
            raise ValueError(f"bad length distribution {spec!r}: use N | uniform:A:B | normal:MEAN:STD | exp:MEAN")
        if nums[0] < 1 or (self.kind == "uniform" and nums[1] < nums[0]):
            raise ValueError(f"bad length distribution {spec!r}: lengths must be >= 1 (and A <= B)")
        self.args = nums

    def sample(self, rng: random.Random) -> int:
        a = self.args
        if self.kind == "fixed":
            return int(a[0])
        if self.kind == "uniform":
            return rng.randint(int(a[0]), int(a[1]))
        if self.kind == "normal":
            return max(1, round(rng.gauss(a[0], a[1])))
        return max(1, round(rng.expovariate(1.0 / a[0])))


def parse_spec(spec: str) -> tuple[LengthDist, LengthDist]:
    spec = PRESETS.get(spec, spec)
    parts = dict(p.split("=", 1) for p in spec.split(",") if "=" in p)
    if set(parts) != {"prompt", "output"} or len(spec.split(",")) != 2:
        raise ValueError(f"bad workload {spec!r}: a JSONL trace file, a preset ({', '.join(PRESETS)}) "
                         "or prompt=DIST,output=DIST")
    return LengthDist(parts["prompt"]), LengthDist(parts["output"])


def arrivals(n: int, rate: float, rng: random.Random, process: str = "poisson") -> list[float]:
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    if process == "uniform":
        return [i / rate for i in range(n)]
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def synthetic(spec: str, n: int, rate: float, seed: int = 0, process: str = "poisson") -> Workload:
    prompt, output = parse_spec(spec)
    if n < 1:
        raise ValueError(f"the number of requests must be >= 1, got {n}")
    rng = random.Random(seed)
    times = arrivals(n, rate, rng, process)
    return Workload(times, [prompt.sample(rng) for _ in range(n)], [output.sample(rng) for _ in range(n)],
                    f"{PRESETS.get(spec, spec)}, {process} at {rate:g} req/s")


def read_trace(path: str) -> Workload:
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                t, p, o = row["arrival_s"], row["prompt_tokens"], row["output_tokens"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"trace {path} line {lineno}: expected a JSON object with arrival_s, "
                                 "prompt_tokens, output_tokens") from None
            if not isinstance(t, (int, float)) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                                                          for x in (p, o)):
                raise ValueError(f"trace {path} line {lineno}: arrival_s must be a number and the token counts "
                                 "integers >= 1")
            if times and t < times[-1]:
                raise ValueError(f"trace {path} line {lineno}: arrival_s {t} goes back in time (sort the trace)")
            times.append(float(t))
            prompts.append(p)
            outputs.append(o)
    if not times:
        raise ValueError(f"trace {path} has no requests")
    return Workload(times, prompts, outputs, f"trace {os.path.basename(path)} ({len(times)} requests)")


def load(spec: str, n: int, rate: float | None, seed: int = 0, process: str = "poisson") -> Workload:
    """A trace path (replayed; re-timed as Poisson at `rate` when given) or a length spec at `rate`."""
    if os.path.exists(spec) or spec.endswith((".jsonl", ".json")):
        trace = read_trace(spec)
        if rate is None:
            return trace
        rng = random.Random(seed)
        idx = [i % len(trace) for i in range(max(n, 1))]
        return Workload(arrivals(len(idx), rate, rng, process), [trace.prompt_tokens[i] for i in idx],
                        [trace.output_tokens[i] for i in idx],
                        f"lengths of {trace.description}, {process} at {rate:g} req/s")
    if rate is None:
        raise ValueError("--rate is required with a length-distribution workload (only a trace has its own times)")
    return synthetic(spec, n, rate, seed, process)
