"""Beam search in the engine (beam groups sharing blocks, tandem/engine/beam_group.py) against the
same search done by resubmitting: every step, one 1-token request per live hypothesis (prompt +
its tokens so far, top-2w logprobs), prefix caching on, the expansion done in Python with the same
selection rule (tandem/engine/beam_search.py). Both run on one engine configuration and must return
the same hypotheses (checked).

Printed per approach: wall time, generated tokens per second (hypothesis-steps: width x steps x
prompts), tokens the model computed, and the peak number of KV blocks referenced by running
sequences (measured when each forward pass starts) and of blocks holding KV at all (referenced +
kept by the prefix cache). Ratios: resubmit / engine, measured in the same run.

    python -m bench.beam_search [--model DIR] [--prompts 8 --prompt-len 200 --width 4 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Meter:
    """Wraps the runner: tokens computed and blocks in use, sampled as each forward pass starts."""

    def __init__(self, llm) -> None:
        self.engine = llm.engine
        self.computed = 0
        self.peak_used = 0
        self.peak_holding = 0
        execute = self.engine.runner.execute

        def measured(out):
            pool = self.engine.kv.pool
            self.computed += sum(s.num_new_tokens for s in out.scheduled)
            self.peak_used = max(self.peak_used, pool.num_used)
            self.peak_holding = max(self.peak_holding, pool.num_blocks - len(pool.free_empty))
            return execute(out)

        self.engine.runner.execute = measured


def engine_search(llm, prompts, args) -> list[list[tuple[list[int], float]]]:
    from tandem import BeamSearchParams

    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens,
                                                     ignore_eos=True))
    return [[(s.output_token_ids, s.cum_logprob) for s in o.sequences] for o in outs]


def resubmit_search(llm, prompts, args) -> list[list[tuple[list[int], float]]]:
    """The search as a client would run it on a plain engine: w requests per step, 1 token each."""
    from tandem import BeamSearchParams, SamplingParams
    from tandem.engine.beam_search import BeamSearch

    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    searches = [BeamSearch(params, set(), args.max_tokens) for _ in prompts]
    live: list[list[tuple[list[int], float]]] = [[([], 0.0)] for _ in prompts]  # (outputs, cum) per hypothesis
    step = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2 * args.width)
    while any(not s.done for s in searches):
        todo = [i for i, s in enumerate(searches) if not s.done]
        batch = [prompts[i] + out for i in todo for out, _ in live[i]]
        results = iter(llm.generate(batch, step))
        for i in todo:
            rows = torch.full((len(live[i]), vocab), float("-inf"))
            for j in range(len(live[i])):
                for tok, lp in next(results).outputs[0].logprobs[0].items():
                    rows[j, tok] = lp
            nexts = searches[i].step([o for o, _ in live[i]], [c for _, c in live[i]], rows)
            live[i] = [(live[i][c.parent][0] + [c.token], c.cum_logprob) for c in nexts]
    return [[(h.token_ids, h.cum_logprob) for h in s.finished] for s in searches]


def run(approach, model, prompts, args) -> tuple[dict, list]:
    from tandem import LLM, BeamSearchParams, SamplingParams

    llm = LLM(model, num_kv_blocks=args.num_blocks, max_model_len=args.prompt_len + args.max_tokens + 16)
    # Warm up (first-call costs of torch's kernels are seconds) on a prompt the measured ones do not share.
    llm.generate([[3] * args.prompt_len], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.beam_search([[4] * args.prompt_len], BeamSearchParams(beam_width=args.width, max_tokens=4, ignore_eos=True))
    meter = Meter(llm)
    t0 = time.perf_counter()
    beams = (engine_search if approach == "engine" else resubmit_search)(llm, prompts, args)
    wall = time.perf_counter() - t0
    llm.engine.check_invariants()
    hyp_tokens = sum(len(h[0]) for b in beams for h in b)
    return {"wall_s": round(wall, 3), "tok_per_s": round(hyp_tokens / wall, 1), "computed_tokens": meter.computed,
            "peak_blocks_used": meter.peak_used, "peak_blocks_holding_kv": meter.peak_holding}, beams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: tandem's shipped model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.model is None:
        from tandem.default_model import default_model_path

        args.model = default_model_path()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 4096) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    results, beams = {}, {}
    for approach in ("resubmit", "engine"):
        results[approach], beams[approach] = run(approach, args.model, prompts, args)
        print(approach, json.dumps(results[approach]), flush=True)
    same = all([t for t, _ in a] == [t for t, _ in b] for a, b in zip(beams["engine"], beams["resubmit"]))
    e, r = results["engine"], results["resubmit"]
    print(json.dumps({"same_hypotheses": same, "speedup": round(r["wall_s"] / e["wall_s"], 2),
                      "computed_ratio": round(r["computed_tokens"] / e["computed_tokens"], 2),
                      "peak_used_ratio": round(r["peak_blocks_used"] / e["peak_blocks_used"], 2),
                      "peak_holding_ratio": round(r["peak_blocks_holding_kv"] / e["peak_blocks_holding_kv"], 2)}))


if __name__ == "__main__":
    main()
