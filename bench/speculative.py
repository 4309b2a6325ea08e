"""Speculative decoding: decode tok/s with and without each speculator at batch 1 and 16, on a
workload whose continuation repeats prompt text (or plain held-out code), plus the draft's and the
EAGLE head's greedy acceptance rates vs the target.

    python -m bench.speculative [--model PATH --draft-model PATH --eagle-head PATH] [--k 4] [--new-tokens 96]
        [--repetition-penalty 1.2]

Models: tandem's shipped target, draft and EAGLE head (`tandem.default_model`, tandem/assets/tiny-target,
tiny-draft, tiny-eagle) unless --model / --draft-model / --eagle-head are given. Prompts are snippets
of held-out standard-library files (the files tools/train_tiny.py holds out: sorted index % 50 == 0).

- repeat workload (default): a snippet, then the snippet's first third again; a model that copies
  continues with text it has seen, which is what prompt lookup (ngram) can guess.
- plain workload (--workload plain): the snippet alone (<= 256 tokens), no planted repetition.
- decode tok/s counts only tokens produced after every request of the batch has its first token
  (prefill excluded). Speculation is forced on at every batch (spec_max_batch = max(batch, 8)); with
  the default (1 on a CPU, 8 on a GPU) the engine switches it off above that and runs at the baseline.
- every configuration has one engine, and they take turns batch by batch: each of --rounds batches (default 1,
  on different prompts; at batch 1 one prompt alone is a thin sample: acceptance varies a lot between prompts)
  runs on every engine before the next batch, the order reversed every other batch, all of it --repeats times
  (default 3). "speedup" is a configuration's decode tok/s over all its batches against the baseline's;
  "paired" the median of the batches' own ratios. Why: this VM's speed drifts up to 2x within minutes, and a
  configuration's whole run against the baseline's whole run seconds later (the fastest of three each, as
  this bench did up to session 38) measured EAGLE at 0.81x where the same runs paired gave 1.02x.
- mean accepted length = draft tokens kept per verifying step (tokens per step is that + 1).
- speculators: none (the baseline), ngram, draft_model, eagle, on the same prompts.
All greedy, so every configuration must produce the same tokens; the bench checks that.

--cpu-clock times with the main thread's CPU clock and one torch thread: on a machine shared with
other jobs the wall clock mostly measures them, the thread's CPU time does not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def heldout_snippets(n: int, chars: int) -> list[str]:
    """Up to n snippets of ~chars characters, each starting at a `def`, from the files tools/train_tiny.py
    holds out: one per file from a third of the way in (past the license header / imports), then more
    from 1/2, 2/3, 1/4, 4/5 and 1/5 of the way in, until there are n (the first pass alone gave 4 at 1200
    characters: too few prompts to measure acceptance on; before 2026-11-27 that was all there was)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}  # as tools/train_tiny.py
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if not skip & set(p.relative_to(root).parts[:-1]))
    texts = []
    for rel in files[::50]:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    out: list[str] = []
    for frac in (3, 2, 1.5, 4, 1.25, 5):
        for text in texts:
            body = text[int(len(text) / frac):]
            start = body.find("\ndef ")
            snippet = body[start + 1:start + 1 + chars]
            if start >= 0 and len(body) - start > chars and snippet not in out:
                out.append(snippet)
            if len(out) == n:
                return out
    return out


def repeat_prompts(tokenizer, n: int) -> list[list[int]]:
    """A snippet (<= 240 tokens) followed by its first third again (BOS not repeated)."""
    prompts = []
    for s in heldout_snippets(n, 600):
        ids = tokenizer.encode(s)[:240]
        prompts.append(ids + ids[1:len(ids) // 3])
    return prompts


CLOCK = time.perf_counter


def make_engine(model: str, **options):
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, max_model_len=1024, kv_cache_memory_gb=0.5,
                                  max_num_batched_tokens=8192, **options))


def decode_batch(engine, prompts: list[list[int]], new_tokens: int,
                 repetition_penalty: float = 1.0) -> tuple[int, float, list]:
    """(Tokens decoded after every request of the batch has its first token, the seconds that took, each
    request's tokens) for `prompts` run together on `engine`."""
    from tandem.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                            repetition_penalty=repetition_penalty)
    ids = [engine.add_request(None, p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while not all(tokens.values()):  # prefill (not timed)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    counted, t = 0, CLOCK()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            counted += len(out.new_token_ids)
    seconds = CLOCK() - t
    engine.check_invariants()
    return counted, seconds, [tokens[i] for i in ids]


def decode_run(model: str, prompts: list[list[int]], new_tokens: int, batch: int | None = None,
               repetition_penalty: float = 1.0, **options) -> tuple[float, list, dict]:
    """Decode tok/s (after every request of a batch has its first token), outputs and spec stats of
    `prompts` run in consecutive batches of `batch` (default: all at once) on one new engine."""
    engine, size, outputs, counted, dt = make_engine(model, **options), batch or len(prompts), [], 0, 0.0
    for first in range(0, len(prompts), size):
        n, seconds, outs = decode_batch(engine, prompts[first:first + size], new_tokens, repetition_penalty)
        counted, dt, outputs = counted + n, dt + seconds, outputs + outs
    return counted / dt, outputs, engine.speculator_stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target checkpoint (default: tandem's shipped tiny-target)")
    ap.add_argument("--draft-model", default=None, help="draft checkpoint (default: tandem's shipped tiny-draft)")
    ap.add_argument("--eagle-head", default=None, help="EAGLE head checkpoint (default: tandem's shipped tiny-eagle)")
    ap.add_argument("--k", type=int, default=4, help="speculated tokens per step")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--workload", choices=("repeat", "plain"), default="repeat")
    ap.add_argument("--rounds", type=int, default=1,
                    help="consecutive batches per configuration, each with the next prompts (batch 1: R prompts)")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the --rounds batches (module doc)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="every request's (the shipped model's generation_config, which HTTP requests get, says 1.2)")
    ap.add_argument("--cpu-clock", action="store_true", help="time with thread CPU time, 1 torch thread")
    args = ap.parse_args()
    if args.cpu_clock:
        global CLOCK
        CLOCK = time.thread_time
        torch.set_num_threads(1)
    model, draft, head = args.model, args.draft_model, args.eagle_head
    if model is None or draft is None or head is None:
        from tandem import default_model

        try:
            model = model or default_model.default_model_path()
            draft = draft or default_model.default_draft_path()
            head = head or default_model.default_eagle_path()
        except (ValueError, AttributeError) as exc:
            raise SystemExit(f"no shipped models ({exc}); pass --model PATH --draft-model PATH --eagle-head PATH")

    from tandem.tokenizer import Tokenizer

    tok = Tokenizer(model)
    pool = repeat_prompts(tok, 16) if args.workload == "repeat" else \
        [tok.encode(s)[:256] for s in heldout_snippets(16, 1200)]
    clock = "thread CPU time" if args.cpu_clock else "wall clock"
    print(f"target={model}\ndraft={draft}\neagle head={head}\nthreads={torch.get_num_threads()} ({clock}) k={args.k} "
          f"new_tokens={args.new_tokens} workload={args.workload} repetition_penalty={args.repetition_penalty}\n"
          f"prompts={len(pool)} (mean {sum(map(len, pool)) / len(pool):.0f} tokens)")
    configs = {"none": {}, "ngram": dict(speculator="ngram"),
               "draft_model": dict(speculator="draft_model", draft_model=draft),
               "eagle": dict(speculator="eagle", draft_model=head)}
    print(f"{'batch':>5} {'speculator':>12} {'decode tok/s':>13} {'speedup':>8} {'paired':>7} {'accept len':>11} "
          f"{'accept rate':>12}")
    for b in (int(x) for x in args.batches.split(",")):
        prompts = [pool[i % len(pool)] for i in range(b * args.rounds)]
        specs = {name: dict(opts, num_speculative_tokens=args.k, spec_max_batch=max(b, 8)) if opts else {}
                 for name, opts in configs.items()}
        # The engines take turns batch by batch, the order reversed every other batch (module doc).
        engines = {name: make_engine(model, **spec) for name, spec in specs.items()}
        runs: dict[str, list[tuple[int, float]]] = {name: [] for name in configs}
        for turn in range(args.repeats * args.rounds):
            batch = prompts[turn % args.rounds * b:(turn % args.rounds + 1) * b]
            outputs = {}
            for name in (list(configs) if turn % 2 == 0 else list(configs)[::-1]):
                n, seconds, outputs[name] = decode_batch(engines[name], batch, args.new_tokens,
                                                         args.repetition_penalty)
                runs[name].append((n, seconds))
            changed = [name for name in configs if outputs[name] != outputs["none"]]
            if changed:
                raise SystemExit(f"greedy output changed with speculator {changed[0]!r}: verification is broken")

        def tok_s(name: str) -> float:
            return sum(n for n, _ in runs[name]) / sum(t for _, t in runs[name])

        for name in configs:
            stats = engines[name].speculator_stats()
            paired = statistics.median((n / t) / (bn / bt) for (n, t), (bn, bt) in zip(runs[name], runs["none"]))
            acc = f"{stats['mean_accepted_length']:.2f}" if stats else "-"
            rate = f"{stats['acceptance_rate']:.1%}" if stats else "-"
            print(f"{b:>5} {name:>12} {tok_s(name):>13.1f} {tok_s(name) / tok_s('none'):>7.2f}x {paired:>6.2f}x "
                  f"{acc:>11} {rate:>12}")
            graphs = getattr(getattr(engines[name].speculator, "runner", None), "graphs", None)  # a GPU's EAGLE
            if graphs is not None:
                print(f"{'':>18} draft graphs: {graphs.replays} proposals drafted, {len(graphs.chains)} captured"
                      f"{', a capture FAILED (Python passes)' if graphs.failed else ''}")

    # The draft and the head as predictors of the target: greedy, K = 4, plain held-out text (no repetition),
    # one prompt at a time (batched, a CPU engine lowers K where the rows would leave its one-call step).
    plain = [tok.encode(s)[:256] for s in heldout_snippets(8, 1200)]
    for name, path in (("draft_model", draft), ("eagle", head)):
        _, _, stats = decode_run(model, plain, args.new_tokens, batch=1, speculator=name, draft_model=path,
                                 num_speculative_tokens=4, spec_max_batch=1)
        per_pos = [a / d if d else 0.0 for a, d in zip(stats["accepted_per_position"], stats["drafted_per_position"])]
        print(f"{name} vs target, greedy, K=4, {len(plain)} held-out prompts: acceptance rate "
              f"{stats['acceptance_rate']:.1%}, mean accepted length {stats['mean_accepted_length']:.2f}, "
              f"per position {', '.join(f'{p:.0%}' for p in per_pos)}")


if __name__ == "__main__":
    main()
