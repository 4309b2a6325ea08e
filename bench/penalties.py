"""What the repetition / frequency / presence penalties cost a decode step: tok/s with them against
the same requests without, for the C pass (kernels/csrc/penalty_cpu.c) and the torch pass it replaced.

    python -m bench.penalties [--model DIR] [--batches 1,16] [--tokens 256] [--rounds 3] [--threads 1]

Why it matters: the shipped model's generation_config asks for repetition_penalty 1.2, which every HTTP
request without its own value gets, so the penalty pass runs on every served step. Greedy, random
token-id prompts of 128 tokens, ignore_eos; each configuration is timed `--rounds` times, alternating,
and the best round kept. Prints tok/s and each penalized row's ratio to the plain row of its round.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tandem import LLM, SamplingParams
from tandem.engine import logits_processors

CASES = [("none", {}), ("repetition 1.2", {"repetition_penalty": 1.2}),
         ("rep 1.2 + freq 0.5 + pres 0.5", {"repetition_penalty": 1.2, "frequency_penalty": 0.5,
                                             "presence_penalty": 0.5})]


def tok_per_s(llm: LLM, prompts: list[list[int]], tokens: int, penalties: dict) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **penalties)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return len(prompts) * tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the shipped model)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, enable_prefix_caching=False)
    native = logits_processors._penalize_native
    passes = {"C": native, "torch": lambda *args: False}
    rng = random.Random(0)
    print(f"threads={a.threads} tokens={a.tokens} best of {a.rounds} rounds (alternated)")
    print(f"{'batch':>5} {'penalties':<30} {'pass':<6} {'tok/s':>8} {'/ none':>7}")
    for batch in map(int, a.batches.split(",")):
        prompts = [[rng.randrange(5, llm.engine.model_config.vocab_size) for _ in range(128)]
                   for _ in range(batch)]
        tok_per_s(llm, prompts, 16, {})  # warm-up
        best: dict[tuple[str, str], float] = {}
        for _ in range(a.rounds):
            for name, pen in CASES:
                for pass_name, fn in passes.items():
                    if not pen and pass_name == "torch":
                        continue  # nothing to pass
                    logits_processors._penalize_native = fn
                    key = (name, pass_name if pen else "-")
                    best[key] = max(best.get(key, 0.0), tok_per_s(llm, prompts, a.tokens, pen))
        logits_processors._penalize_native = native
        plain = best[("none", "-")]
        for (name, pass_name), value in best.items():
            print(f"{batch:>5} {name:<30} {pass_name:<6} {value:>8.1f} {value / plain:>6.2f}x")


if __name__ == "__main__":
    main()
