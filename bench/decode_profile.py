"""Where a batch-1 decode step's time goes: torch.profiler over N engine steps of one request.

Prints the step time, the top ops by self CPU time and, on a GPU, the CUDA runtime calls per step
(kernel launches, host-device copies, synchronizations: what keeps a small model far under the weight
bandwidth limit there). Runs on the CPU too (no CUDA rows).

    python -m bench.decode_profile [--model DIR] [--steps 32] [--dtype auto] [--top 15]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter

import torch

from bench.offline_throughput import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the ~55M benchmark Llama, built here)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (GPU)")
    args = ap.parse_args()
    from tandem import SamplingParams
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    path = args.model or tempfile.mkdtemp(prefix="tandem-profile-")
    if not args.model:
        build_model(path)
    engine = LLMEngine(EngineConfig(model=path, max_model_len=1024, kv_cache_memory_gb=0.5, dtype=args.dtype,
                                    enforce_eager=args.enforce_eager))
    cuda = engine.config.torch_device.type == "cuda"
    engine.add_request("r", [7] * 32, SamplingParams(temperature=0, max_tokens=2 * args.steps + 24, ignore_eos=True))
    for _ in range(24):  # prefill, then warm steps (allocator growth, kernel compiles)
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    plain_ms = (time.perf_counter() - t) * 1e3 / args.steps
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
    where = torch.cuda.get_device_name() if cuda else f"cpu threads={torch.get_num_threads()}"
    print(f"{where} {engine.config.torch_dtype}: batch-1 decode step {plain_ms:.2f} ms "
          f"({1e3 / plain_ms:.0f} tok/s) unprofiled; graph replays "
          f"{getattr(engine.runner.decode_graphs, 'replays', 0)}")
    sort = "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=48))
    calls = Counter()
    for e in prof.key_averages():
        if e.key.startswith("cuda") or e.key.startswith("aten::item") or e.key.startswith("aten::_local_scalar"):
            calls[e.key] += e.count
    for name, n in calls.most_common(12):
        print(f"{name:48s} {n / args.steps:8.1f} per step")


if __name__ == "__main__":
    main()
