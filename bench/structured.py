"""Structured outputs: decode throughput with and without a grammar, and grammar compile time.

    python -m bench.structured [--model DIR] [--rounds 5] [--tokens 128] [--step-times]

Batch 1 and 16 greedy requests of `--tokens` tokens on the shipped model (128: a batch-1 run is ~0.1 s,
short enough for this VM's jitter to swing single rounds by +-40%: use more tokens for a steadier
ratio), each batch run unconstrained and under a regex that never ends early (`[a-z ]*`, so both runs
produce the same token count: checked; the bounded `[a-z ]{0,400}` used before ended requests after 400
characters, ~100 tokens, so its batches shrank and its tok/s counted that as overhead), `--rounds`
times, A/B then B/A (which goes first alternates by round); reports median tok/s and the overhead
(target <= 5%), also as the median of each round's own ratio. Then the compile time of a JSON
schema, cold and from the cache.

`--step-times`: instead, per-step costs (steadier than tok/s on a drifting VM): batch-1 plain and grammar
requests alternated in one engine, every step timed and the forward (ModelRunner.forward) inside it; prints
the p10 / p50 of the whole step and of the step outside the forward, grammar minus plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {"type": "object", "required": ["name", "tags", "score"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 40}, "score": {"type": "number"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5}}}


def main() -> None:
    from tandem import LLM, SamplingParams
    from tandem.default_model import ASSETS_DIR, TARGET_NAME

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ASSETS_DIR / TARGET_NAME))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--step-times", action="store_true", help="per-step p10 / p50, grammar minus plain")
    a = ap.parse_args()
    llm = LLM(a.model)
    spec = {"regex": "[a-z ]*"}
    if a.step_times:
        step_times(llm, spec, a.rounds, a.tokens)
        return

    def tok_s(batch: int, structured: bool) -> float:
        p = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True,
                           structured_outputs=spec if structured else None)
        prompts = [f"# note {i}\n" for i in range(batch)]
        t = time.perf_counter()
        outs = llm.generate(prompts, p)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for o in outs)
        assert tokens == batch * a.tokens, f"{tokens} tokens, expected {batch * a.tokens}: a request ended early"
        return tokens / elapsed

    for batch in (1, 16):
        tok_s(batch, True), tok_s(batch, False)  # warm-up
        plain, constrained = [], []
        for r in range(a.rounds):  # which run goes first alternates: no order effect (GC, allocator) favours one
            for structured in ((False, True) if r % 2 == 0 else (True, False)):
                (constrained if structured else plain).append(tok_s(batch, structured))
        p, c = statistics.median(plain), statistics.median(constrained)
        # Paired: each round's two runs are seconds apart, so the VM's drift (2x within minutes
        # here) cancels in their ratio far better than in a ratio of medians.
        paired = statistics.median(1 - ci / pi for pi, ci in zip(plain, constrained))
        print(f"batch {batch:2}: unconstrained {p:8.1f} tok/s, grammar {c:8.1f} tok/s, overhead {1 - c / p:6.1%} "
              f"(median of per-round pairs {paired:6.1%})")
    grammars = llm.engine.grammars
    t = time.perf_counter()
    grammars.compile({"json": SCHEMA})
    cold = time.perf_counter() - t
    t = time.perf_counter()
    grammars.compile({"json": SCHEMA})
    print(f"JSON schema compile: {cold * 1e3:.2f} ms cold, {(time.perf_counter() - t) * 1e6:.0f} us cached")


def step_times(llm, spec: dict, rounds: int, tokens: int) -> None:
    from tandem import SamplingParams
    from tandem.engine.model_runner import ModelRunner

    engine, forward_ns = llm.engine, []
    forward = ModelRunner.forward

    def timed_forward(*args, **kwargs):
        t = time.perf_counter_ns()
        out = forward(*args, **kwargs)
        forward_ns.append(time.perf_counter_ns() - t)
        return out

    ModelRunner.forward = timed_forward  # type: ignore[method-assign]

    def run(structured: bool) -> list[tuple[int, int]]:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                structured_outputs=spec if structured else None)
        engine.add_request(None, engine.tokenizer.encode("# note 1\n"), params)
        steps, forward_ns[:] = [], []
        while engine.has_unfinished_requests():
            t = time.perf_counter_ns()
            engine.step()
            steps.append(time.perf_counter_ns() - t)
        return list(zip(steps, forward_ns))[3:-1]  # decode steps: not the prompt's, not the last

    run(False), run(True)
    times: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    for r in range(rounds):
        for structured in ((False, True) if r % 2 == 0 else (True, False)):
            times[structured] += run(structured)

    def q(values: list[int], p: float) -> float:
        return sorted(values)[int(p * (len(values) - 1))] / 1e3

    for p in (0.1, 0.5):
        whole = [q([s for s, _ in times[g]], p) for g in (False, True)]
        outside = [q([s - f for s, f in times[g]], p) for g in (False, True)]
        print(f"p{int(p * 100)}: step {whole[0]:.1f} -> {whole[1]:.1f} us (+{whole[1] - whole[0]:.1f}, "
              f"{whole[1] / whole[0] - 1:.1%}); outside the forward {outside[0]:.1f} -> {outside[1]:.1f} us "
              f"(+{outside[1] - outside[0]:.1f})")


if __name__ == "__main__":
    main()
