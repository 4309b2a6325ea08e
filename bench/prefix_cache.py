"""Prefix-cache hit rate per eviction policy on a multi-tenant workload, through the real engine.

Workload (seeded, identical for every policy): `--tenants` system prompts of 6-12 blocks whose
popularity follows a Zipf law (`--zipf`); each tenant has `--users-per-tenant` users; a request picks
a tenant by popularity, then a user, who either opens a new conversation (system prompt + a fresh
question) or, with probability `--follow-up`, continues their last one (previous prompt + answer +
a new message). Requests keep `--concurrency` in flight, as a server would. The KV cache holds
`--cache-fraction` of the distinct blocks the trace touches, so the policy has to choose.

Printed per policy: prefix hit rate (cached prompt tokens / prompt tokens), its ratio to `lru`
measured in the same run, and the ceiling (the same trace with a cache that never evicts).

    python -m bench.prefix_cache [--requests 400 --cache-fraction 0.25 --policies lru,lfu,prefix_aware]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(slots=True)
class Turn:
    tenant: int
    user: int
    new_tokens: list[int]  # appended to the user's conversation (or to the system prompt if fresh)
    fresh: bool


def make_trace(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[Turn]]:
    rng = random.Random(args.seed)
    bs = args.block_size
    systems = [[rng.randrange(3, vocab) for _ in range(rng.randint(6, 12) * bs)] for _ in range(args.tenants)]
    weights = [1 / (k + 1) ** args.zipf for k in range(args.tenants)]
    started: set[tuple[int, int]] = set()
    turns = []
    for _ in range(args.requests):
        tenant = rng.choices(range(args.tenants), weights)[0]
        user = rng.randrange(args.users_per_tenant)
        fresh = (tenant, user) not in started or rng.random() >= args.follow_up
        started.add((tenant, user))
        n = rng.randint(bs, 3 * bs) if fresh else rng.randint(bs // 2, 2 * bs)
        turns.append(Turn(tenant, user, [rng.randrange(3, vocab) for _ in range(n)], fresh))
    return systems, turns


def replay(model: str, args: argparse.Namespace, policy: str, num_blocks: int, systems, turns) -> dict:
    """Run the trace; a follow-up's prompt is the user's last prompt + the answer the engine gave."""
    from tandem import LLM, SamplingParams

    llm = LLM(model, eviction=policy, num_kv_blocks=num_blocks, block_size=args.block_size,
              max_model_len=args.max_model_len, max_num_seqs=args.concurrency)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    history: dict[tuple[int, int], list[int]] = {}
    busy: dict[tuple[int, int], str] = {}  # a user waits for their answer before the next message
    rid_user: dict[str, tuple[int, int]] = {}
    queue, prompt_tokens, hit_tokens = list(turns), 0, 0
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and len(busy) < args.concurrency:
            i = next((i for i, t in enumerate(queue) if (t.tenant, t.user) not in busy), None)
            if i is None:
                break
            t = queue.pop(i)
            key = (t.tenant, t.user)
            prompt = (systems[t.tenant] if t.fresh else history[key]) + t.new_tokens
            prompt = prompt[-(args.max_model_len - args.output_tokens - 1):]  # keep the newest context
            history[key] = prompt
            rid = engine.add_request(None, prompt, params)
            busy[key], rid_user[rid] = rid, key
        for out in engine.step():
            if out.finished:
                key = rid_user.pop(out.request_id)
                busy.pop(key)
                history[key] = history[key] + out.token_ids
                prompt_tokens += len(out.prompt_token_ids)
                hit_tokens += out.num_cached_tokens
    engine.check_invariants()
    return {"hit_rate": hit_tokens / prompt_tokens, "seconds": time.perf_counter() - start,
            "preemptions": engine.scheduler.num_preemptions}


def distinct_blocks(systems, turns, bs: int) -> int:
    """Upper estimate of the trace's distinct full blocks (answers not known before running)."""
    seen, hist = set(), {}
    for t in turns:
        key = (t.tenant, t.user)
        prompt = (systems[t.tenant] if t.fresh else hist[key]) + t.new_tokens
        hist[key] = prompt
        seen.update(tuple(prompt[:(i + 1) * bs]) for i in range(len(prompt) // bs))
    return len(seen)


def default_model() -> str:
    try:
        from tandem.default_model import default_model_path

        return default_model_path()
    except (ImportError, FileNotFoundError):
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import make_checkpoint  # needs transformers (a test dependency)

        return make_checkpoint(tempfile.mkdtemp(prefix="tandem-bench-"), "llama")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the packaged tiny model)")
    p.add_argument("--policies", default="lru,lfu,prefix_aware")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of tenant popularity")
    p.add_argument("--users-per-tenant", type=int, default=20)
    p.add_argument("--follow-up", type=float, default=0.3, help="chance a returning user continues")
    p.add_argument("--cache-fraction", type=float, default=0.25, help="cache size / distinct blocks of the trace")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = args.model or default_model()
    from tandem.models.config import ModelConfig

    systems, turns = make_trace(args, ModelConfig.from_dir(model).vocab_size)
    distinct = distinct_blocks(systems, turns, args.block_size)
    # Never below what the in-flight requests need at once, or the engine would only thrash.
    floor = args.concurrency * args.max_model_len // args.block_size // 2
    num_blocks = max(int(distinct * args.cache_fraction), floor)
    print(f"trace: {args.requests} requests, {args.tenants} tenants (Zipf {args.zipf}), "
          f"{args.tenants * args.users_per_tenant} users, ~{distinct} distinct blocks; "
          f"cache {num_blocks} blocks ({num_blocks / distinct:.0%} of them)")
    ceiling = replay(model, args, "lru", 10 * distinct + floor, systems, turns)
    results = {name: replay(model, args, name, num_blocks, systems, turns) for name in args.policies.split(",")}
    base = results.get("lru", next(iter(results.values())))["hit_rate"]
    print(f"{'policy':<14}{'hit rate':>10}{'vs lru':>9}{'seconds':>9}{'preempt':>9}")
    for name, r in results.items():
        print(f"{name:<14}{r['hit_rate']:>10.3f}{r['hit_rate'] / base:>8.2f}x{r['seconds']:>9.1f}{r['preemptions']:>9}")
    print(f"{'no eviction':<14}{ceiling['hit_rate']:>10.3f}{ceiling['hit_rate'] / base:>8.2f}x  (ceiling)")


if __name__ == "__main__":
    main()
