"""Measure a profile with the real engine on this machine: prefill, decode and KV-transfer step times.

1. Prefill: one fresh prompt of n tokens per step (n up to the chunk budget), then whole prompts
   under smaller chunk budgets (the attention to earlier chunks). Random token ids: no prefix hits.
2. Decode: for each context length, seat the largest batch once, time steps, then abort requests
   down to each smaller batch size (the prompts are distinct, so no cache sharing flatters the reads).
3. KV transfer: the connector's sender here, its receiver in a spawned process (as on a decode
   worker), moving every layer of n tokens' blocks and waiting for the acknowledgement.
Every point is the median of a few repetitions after a warm-up. Progress goes to `progress(done, total, what)`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.planner.profile import EngineSettings, ModelIdentity, Profile, model_config_hash
from tandem.sampling_params import SamplingParams, model_defaults


@dataclass(slots=True)
class Plan:
    prefill_tokens: list[int]
    chunked: list[tuple[int, int]]  # (prompt tokens, chunk budget)
    batches: list[int]
    contexts: list[int]
    transfer_tokens: list[int]
    reps: int
    decode_steps: int
    passes: int = 1  # decode grid passes; the lower median of each point is kept (a busy moment is not the engine)

    @property
    def total(self) -> int:
        return len(self.prefill_tokens) + len(self.chunked) + len(self.batches) * len(self.contexts) * self.passes + \
            len(self.transfer_tokens)


def make_plan(max_len: int, budget: int, seats: int, quick: bool, kv_blocks: int | None = None,
              block_size: int = 16) -> Plan:
    top = min(budget, max_len - 1)
    if quick:
        return Plan([16, 64], [(96, 32)], [b for b in (1, 4) if b <= seats] or [1], [16, 64], [16, 64], 2, 3)
    lengths = sorted({n for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= top} | {top})
    long = max_len - 1
    chunked = [(long, c) for c in (64, 128, 256, 512) if c < min(long, budget)]
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= seats} | {seats})
    steps = 8
    # The longest context measured must leave room for the tokens decoded while the batch is being
    # prefilled and then timed, or requests would hit max_model_len mid-measurement.
    drift = -(-max(batches) * max_len // budget) + (steps + 1) * len(batches) + 16
    top_ctx = max(16, max_len - drift)
    if kv_blocks is not None:  # the largest batch must fit the KV cache at the longest context (+ its drift)
        top_ctx = max(16, min(top_ctx, kv_blocks // max(batches) * block_size - drift))
    contexts = sorted({c for c in (16, 128, 512, 2048) if c < top_ctx} | {top_ctx})
    return Plan(lengths, chunked, batches, contexts, [16, 128, 512, max_len - 1], 3, steps, passes=2)


def measure(config: EngineConfig, threads: int, connector: str, quick: bool,
            progress: Callable[[int, int, str], None]) -> Profile:
    torch.set_num_threads(threads)
    engine = LLMEngine(config)
    sched = engine.scheduler
    budget, seats = sched.max_num_batched_tokens, sched.max_num_seqs
    plan = make_plan(engine.max_model_len, budget, seats, quick, engine.num_kv_blocks, config.block_size)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        progress(done, plan.total, what)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]  # above the usual special ids

    def prefill_once(n: int) -> float:
        engine.add_request(None, prompt(n), SamplingParams(**{**model_defaults(engine.config.model), "max_tokens": 1,
                                                               "ignore_eos": True}))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t0

    prefill_once(32)  # warm-up: first-call allocations, thread pool start
    progress(0, plan.total, "prefill")
    prefill = []
    for n in plan.prefill_tokens:
        prefill.append({"tokens": n, "seconds": statistics.median(prefill_once(n) for _ in range(plan.reps))})
        tick(f"prefill {n} tokens")
    chunked = []
    for n, chunk in plan.chunked:
        sched.max_num_batched_tokens = chunk  # the token budget of the next steps: the chunk size
        try:
            secs = statistics.median(prefill_once(n) for _ in range(plan.reps))
        finally:
            sched.max_num_batched_tokens = budget
        chunked.append({"prompt_tokens": n, "chunk_budget": chunk, "seconds": secs})
        tick(f"prefill {n} tokens in chunks of {chunk}")
    best: dict[tuple[int, int], float] = {}
    for p in range(plan.passes):
        for c in plan.contexts:
            for b, secs in decode_times(engine, c, plan, prompt):
                best[(b, c)] = min(secs, best.get((b, c), secs))
                tick(f"decode batch {b} context {c} (pass {p + 1}/{plan.passes})")
    decode = [{"batch": b, "context": c, "seconds": secs} for (b, c), secs in sorted(best.items())]
    layout = engine.kv_layout
    transfer: dict = {"connector": connector, "points": []}
    if connector != "none":
        for n, secs in transfer_times(connector, layout, plan):
            transfer["points"].append({"bytes": blocks_for(n, layout.block_size) * layout.bytes_per_block,
                                       "seconds": secs})
            tick(f"kv transfer {n} tokens")
    return Profile(
        model=ModelIdentity(config.model, model_config_hash(config.model), layout.num_layers,
                            layout.bytes_per_block // layout.block_size, engine.max_model_len),
        engine=EngineSettings(str(config.torch_dtype).removeprefix("torch."), layout.kv_cache_dtype,
                              config.block_size, budget, seats, threads, engine.num_kv_blocks),
        prefill=prefill, prefill_chunked=chunked, decode=decode, kv_transfer=transfer,
        machine={"host": platform.node(), "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "quick": quick})


def decode_times(engine: LLMEngine, context: int, plan: Plan,
                 prompt: Callable[[int], list[int]]) -> list[tuple[int, float]]:
    """(batch, seconds per decode step) at about `context` tokens, largest batch first."""
    big = max(plan.batches)
    # As served: a request that leaves its sampling fields unset gets the checkpoint's generation_config
    # defaults (the shipped model's repetition_penalty 1.2 costs ~2 ms a step at batch 64).
    params = SamplingParams(**{**model_defaults(engine.config.model), "max_tokens": 10**6, "ignore_eos": True})
    ids = [engine.add_request(None, prompt(context), params) for _ in range(big)]
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()  # prefill everything (chunked with the decodes of the early ones)
    out = []
    live = list(ids)
    for b in sorted(plan.batches, reverse=True):
        while len(live) > b:
            engine.abort_request(live.pop())
        if len(engine.scheduler.running) != b:
            raise ValueError(f"cannot hold a batch of {b} at context {context} (KV cache or max_model_len too "
                             "small for the decode grid; raise --kv-cache-memory-gb or lower --max-num-seqs)")
        engine.step()  # the first step after a change re-plans the batch's buckets
        times = []
        for _ in range(plan.decode_steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        out.append((b, statistics.median(times)))
    for rid in live:
        engine.abort_request(rid)
    return sorted(out)


def blocks_for(tokens: int, block_size: int) -> int:
    return (tokens + block_size - 1) // block_size


def _receiver(connector: str, layout_dict: dict, n_blocks: int, conn) -> None:
    """Decode worker's half, in its own process: receive into a cache, acknowledge, until told to stop."""
    from kvtransfer import CONNECTORS, CacheLayout

    torch.set_num_threads(1)
    layout = CacheLayout.from_dict(layout_dict)
    c = CONNECTORS[connector](timeout_s=120)
    caches, scales = c.allocate_kv_caches(layout, n_blocks)
    rx = c.make_receiver(layout, caches, scales, "tcp://127.0.0.1:*" if connector != "shm" else None)
    conn.send(rx.address)
    try:
        while True:
            if conn.poll():
                msg = conn.recv()
                if msg is None:
                    break
                rx.expect(msg[0], msg[1])
            rx.poll(5)
    finally:
        rx.close()
        c.free_kv_caches(caches)


def transfer_times(connector: str, layout, plan: Plan) -> list[tuple[int, float]]:
    from kvtransfer import CONNECTORS
    from kvtransfer.base import allocate_kv_caches

    n_blocks = blocks_for(max(plan.transfer_tokens), layout.block_size)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(connector, layout.to_dict(), n_blocks + 1, theirs), daemon=True)
    proc.start()
    try:
        if not mine.poll(60):
            raise RuntimeError(f"the {connector} KV receiver did not start")
        address = mine.recv()
        tx = CONNECTORS[connector]().make_sender(layout, "cpu")
        tx.connect(address)
        cache, scales = allocate_kv_caches(layout, n_blocks + 1)  # P's side (zeros move like any bytes)
        out, seq = [], 0
        for n in plan.transfer_tokens:
            blocks = list(range(blocks_for(n, layout.block_size)))
            times = []
            for _ in range(plan.reps + 1):  # the first is a warm-up
                seq += 1
                rid = f"profile-{seq}"
                mine.send((rid, blocks))
                time.sleep(0.01)  # let the receiver register the expectation first
                t0 = time.perf_counter()
                for layer in range(layout.num_layers):
                    tx.send_layer(address, rid, layer, cache[layer], scales[layer] if scales else None,
                                  blocks, blocks)
                if not tx.finish(rid, timeout_s=60):
                    raise RuntimeError(f"the {connector} KV receiver did not acknowledge a transfer")
                times.append(time.perf_counter() - t0)
            out.append((n, statistics.median(times[1:])))
        tx.close()
        return out
    finally:
        mine.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
