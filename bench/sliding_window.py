"""Sliding-window attention at a fixed KV budget: how many sequences of a long context run at once,
and how fast, with the window (blocks released behind it) vs the same model with full attention.

Two random Mistral checkpoints that differ only in `sliding_window` (`--window` vs none) serve the
same seeded requests (prompts of `--context - --output` tokens, `--output` tokens each, greedy,
ignore_eos) through the offline engine with the same `--num-kv-blocks`. Printed per model: the most
requests running at once, the most blocks one request held, wall time and output tok/s, and the
ratios (window / full). The model is small on purpose: the KV budget, not the GEMMs, is the subject.

    python -m bench.sliding_window [--context 4096 --window 512 --output 128 --requests 24 --num-kv-blocks 1024]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(path: str, window: int | None, context: int) -> str:
    """A small random Mistral (4 layers, hidden 256, GQA 8/2) with the tokenizer the tests use."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers as tf

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import write_tokenizer

    cfg = tf.MistralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2 * context,
                           sliding_window=window, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    tf.MistralForCausalLM(cfg).save_pretrained(path)
    write_tokenizer(path)
    return path


def run(model: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from tandem import LLM, SamplingParams

    llm = LLM(model, num_kv_blocks=args.num_kv_blocks, max_model_len=args.context,
              max_num_batched_tokens=args.chunk, max_num_seqs=args.requests)
    sched = llm.engine.scheduler
    peak = {"running": 0, "blocks_per_request": 0}
    update = sched.update

    def observed(out, sampled):  # measure after every step, as the engine's own counters would
        peak["running"] = max(peak["running"], len(sched.running))
        for r in sched.running:
            peak["blocks_per_request"] = max(peak["blocks_per_request"], sum(b >= 0 for b in r.block_ids))
        return update(out, sampled)

    sched.update = observed
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {**peak, "wall_s": wall, "tok_s": tokens / wall, "preemptions": sched.num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--num-kv-blocks", type=int, default=1024, help="the fixed KV budget (16-token blocks)")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: repeatable on a shared machine)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(args.context - args.output)] for _ in range(args.requests)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("full", None), ("window", args.window)):
            path = build(os.path.join(tmp, name), window, args.context)
            results[name] = run(path, args, prompts)
            r = results[name]
            print(f"{name:>7}: {r['running']:3d} running at most, {r['blocks_per_request']:4d} blocks/request at "
                  f"most, {r['preemptions']:3d} preemptions, {r['wall_s']:7.1f} s, {r['tok_s']:7.1f} output tok/s",
                  flush=True)
    w, f = results["window"], results["full"]
    print(f"context {args.context}, window {args.window}, budget {args.num_kv_blocks} blocks x 16 tokens, "
          f"{args.requests} requests: window/full concurrent sequences {w['running'] / f['running']:.2f}x, "
          f"output tok/s {w['tok_s'] / f['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
