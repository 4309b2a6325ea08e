"""Train and export tandem's shipped EAGLE head for `tiny-target`: `tandem/assets/tiny-eagle/`.

The recipe, end to end (the target stays frozen; only the head learns):
  1. corpus   - tools/train_tiny.py's (standard library *.py, the same held-out files), encoded with
                the shipped tokenizer into the same non-overlapping 256-token windows.
  2. features - the shipped target (bf16 weights computed in fp32, as the engine runs them) gives its
                final post-norm hidden states f[p] for every window, on the fly.
  3. head     - fc(concat(embed(t[p+1]), f[p])) -> one Llama decoder layer (no input norm) ->
                a prediction of f[p+1]; embedding and lm_head are the target's (tied), frozen.
  4. loss     - cross-entropy of the head's logits (through the target's lm_head) against the target's
                own next-token distribution at p+1 (what drafts must agree with), plus smooth-L1
                regression of f[p+1] (EAGLE-1). Unrolled passes (--unroll, weights 1/u) feed the head its
                own predicted states, as drafting does after the first token, with the same targets.
  4b. distill - then --distill-steps more on windows the target wrote itself: a training window's first
                32-127 tokens continued greedily by tandem's engine. Drafting meets the target's own
                text, not the corpus's (on the shipped model this raised the accepted length per step
                more than the same steps on corpus text).
  5. export   - bf16 safetensors with vLLM's EAGLE names (`fc.weight`, `layers.0.*`) + config.json, and a
                draft vocabulary: the --draft-vocab most frequent tokens of the training windows, as
                EAGLE-3's `d2t` offsets + `draft_vocab_size` (the head drafts among those only; its
                lm_head is the target's rows of them). `--draft-vocab-only` redoes just this on an export.
  6. verify   - tandem's engine loads the export and drafts for the target: greedy acceptance on
                held-out prompts lands in tandem/assets/eagle_train_stats.json (for the model card).

Fixed seeds, batch order and step counts; the thread count changes the floating-point sums, so a rerun
matches bitwise only with the same --threads (default 2).

    python tools/train_eagle.py            # == --steps 1800 --distill-steps 1600 --unroll 3 --threads 2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_llama import Cfg, Layer, TinyLlama, rope_tables  # noqa: E402
from train_tiny import ASSETS, corpus, log, to_windows  # noqa: E402

TARGET, HEAD = "tiny-target", "tiny-eagle"


class Head(nn.Module):
    """The EAGLE head with vLLM's parameter names; `forward` = tandem/models/eagle.py's math."""

    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.cfg = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([Layer(c)])
        self.layers[0].input_layernorm = nn.Identity()
        nn.init.normal_(self.fc.weight, std=0.02)
        for name, p in self.layers.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight"))
                                               else 1))

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.cfg, embeds.shape[1])
        x = self.fc(torch.cat([embeds, feats], dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def load_target(path: Path) -> TinyLlama:
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    cfg = Cfg(raw["vocab_size"], raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"],
              raw["num_key_value_heads"], raw["intermediate_size"], raw["rope_theta"], raw["rms_norm_eps"],
              raw["max_position_embeddings"])
    model = TinyLlama(cfg)
    model.load_state_dict({k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()})
    return model.eval().requires_grad_(False)


@torch.no_grad()
def features(target: TinyLlama, ids: torch.Tensor) -> torch.Tensor:
    """The target's final post-norm hidden states [B, T, H] (what tandem's engine hands a speculator)."""
    cos, sin = rope_tables(target.cfg, ids.shape[1])
    x = target.model.embed_tokens(ids)
    for layer in target.model.layers:
        x = layer(x, cos, sin)
    return target.model.norm(x)


def losses(head: Head, target: TinyLlama, ids: torch.Tensor, unroll: int) -> tuple[torch.Tensor, dict]:
    """Head position p (p < T-1) pairs f[p] with t[p+1] and is trained towards f[p+1] / the target's
    distribution there. Pass u > 1 replaces f[p] (p >= 1) by the previous pass's prediction of it."""
    emb_w = target.model.embed_tokens.weight
    f = features(target, ids)
    embeds = target.model.embed_tokens(ids[:, 1:])
    want = f[:, 1:]
    want_p = F.softmax(want @ emb_w.T, dim=-1)
    want_top = want_p.argmax(-1)
    feats, total, stats = f[:, :-1], 0.0, {}
    for u in range(unroll):
        pred = head(embeds, feats)
        logp = F.log_softmax(pred @ emb_w.T, dim=-1)
        ce = -(want_p * logp).sum(-1).mean()
        reg = F.smooth_l1_loss(pred, want)
        total = total + (ce + reg) / (u + 1)
        stats[f"ce{u}"], stats[f"reg{u}"] = ce.item(), reg.item()
        stats[f"top1_{u}"] = (logp.argmax(-1) == want_top).float().mean().item()
        feats = torch.cat([f[:, :1], pred[:, :-1]], dim=1)
    return total, stats


def draft_vocab(data: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the training windows (ties: the lower id), ascending."""
    counts = torch.bincount(data.flatten(), minlength=vocab)
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values


def export(sd: dict[str, torch.Tensor], target_dir: Path, out: Path, vocab_ids: torch.Tensor | None) -> None:
    """Write the head (its state dict, any dtype) as bf16 safetensors + config.json, with the draft
    vocabulary vocab_ids (None: the whole vocabulary)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items() if k not in ("d2t", "t2d")}
    if vocab_ids is not None and len(vocab_ids) < cfg["vocab_size"]:
        cfg["draft_vocab_size"] = len(vocab_ids)
        sd["d2t"] = (vocab_ids - torch.arange(len(vocab_ids))).to(torch.int64)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def acceptance(target_dir: Path, head_dir: Path, held_files: list[tuple[str, str]], k: int) -> dict:
    """tandem's engine, greedy, K = k: how many of the head's drafts the target keeps on held-out text."""
    from tandem import LLM, SamplingParams

    llm = LLM(str(target_dir), speculator="eagle", draft_model=str(head_dir), num_speculative_tokens=k,
              max_model_len=512, spec_max_batch=8)
    tok = llm.engine.tokenizer
    prompts = [tok.encode(text[len(text) // 3:][:1200])[:256] for _, text in held_files[:8]]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True))
    st = llm.engine.speculator_stats()
    return {"k": k, "prompts": len(prompts), "acceptance_rate": st["acceptance_rate"],
            "mean_accepted_length": st["mean_accepted_length"],
            "per_position": [a / d for a, d in zip(st["accepted_per_position"], st["drafted_per_position"])]}


def fit(head: Head, target: TinyLlama, windows: torch.Tensor, steps: int, batch: int, lr_at, unroll: int,
        name: str, a: argparse.Namespace) -> float:
    """`steps` AdamW steps over consecutive batches of `windows` (wrapping), lr_at(step) the learning rate;
    returns the seconds it took."""
    decay = [p for p in head.parameters() if p.dim() == 2]
    other = [p for p in head.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=lr_at(0), betas=(0.9, 0.95))
    recent: list[dict] = []
    t0 = time.time()
    for step in range(steps):
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        i = (step * batch) % (len(windows) - batch + 1)
        loss, st = losses(head, target, windows[i:i + batch], unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        recent.append(st)
        if (step + 1) % a.log_every == 0 or step + 1 == steps:
            mean = {k: sum(s[k] for s in recent) / len(recent) for k in recent[0]}
            recent = []
            log(f"{name} step {step + 1}/{steps} lr {lr:.2e} " + " ".join(f"{k} {v:.4f}" for k, v in mean.items())
                + f" elapsed {time.time() - t0:.0f}s", a.log)
    return time.time() - t0


def generated_windows(target_dir: Path, data: torch.Tensor, n: int, seq: int, seed: int) -> torch.Tensor:
    """n windows of `seq` tokens that the target wrote itself: a training window's first 32-127 tokens
    (lengths spread deterministically), then tandem's engine's greedy continuation of them."""
    from tandem import LLM, SamplingParams

    llm = LLM(str(target_dir), max_model_len=seq + 64, max_num_seqs=64)
    pick = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:n]
    prompts = [data[int(w)][:32 + (i * 37) % 96].tolist() for i, w in enumerate(pick)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=seq - len(p), ignore_eos=True)
                                  for p in prompts])
    return torch.tensor([p + o.outputs[0].token_ids for p, o in zip(prompts, outs)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--distill-steps", type=int, default=1600,
                    help="then steps on windows the target wrote itself (what drafting meets)")
    ap.add_argument("--distill-lr", type=float, default=5e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--unroll", type=int, default=3, help="passes per batch; >1 trains on the head's own states")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--draft-vocab", type=int, default=1024, help="tokens the head drafts among (0: all)")
    ap.add_argument("--draft-vocab-only", action="store_true",
                    help="no training: rewrite the existing export's draft vocabulary (--draft-vocab) only")
    ap.add_argument("--assets", type=Path, default=ASSETS)
    ap.add_argument("--log", default="/tmp/train_eagle.log")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)
    t_start = time.time()
    from tokenizers import Tokenizer

    target_dir, out = a.assets / TARGET, a.assets / HEAD
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    train_files, held_files = corpus()
    data = to_windows(tok, [t for _, t in train_files], a.seq)
    held = to_windows(tok, [t for _, t in held_files], a.seq)
    log(f"{len(train_files)} train / {len(held_files)} held-out files: {data.numel():,} / {held.numel():,} "
        "tokens", a.log)
    vocab_ids = draft_vocab(data, tok.get_vocab_size(), a.draft_vocab) if a.draft_vocab > 0 else None
    stats_path = a.assets / "eagle_train_stats.json"
    if a.draft_vocab_only:
        from safetensors.torch import load_file

        export(load_file(str(out / "model.safetensors")), target_dir, out, vocab_ids)
        stats = json.loads(stats_path.read_text())
        stats["draft_vocab"] = a.draft_vocab
        stats["acceptance"] = [acceptance(target_dir, out, held_files, k) for k in (3, 4)]
        stats_path.write_text(json.dumps(stats, indent=2) + "\n")
        log(json.dumps(stats["acceptance"], indent=1), a.log)
        return
    target = load_target(target_dir)
    torch.manual_seed(a.seed)
    head = Head(target.cfg)
    nparams = sum(p.numel() for p in head.parameters())
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(a.seed + 1))

    def corpus_lr(step: int) -> float:  # warmup, then cosine to 10%
        return a.lr * (step + 1) / a.warmup if step < a.warmup else \
            a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - a.warmup) / max(1, a.steps - a.warmup))))

    train_seconds = fit(head, target, data[perm], a.steps, a.batch, corpus_lr, a.unroll, "corpus", a)
    gen_seconds = distill_seconds = 0.0
    if a.distill_steps:
        t0 = time.time()
        written = generated_windows(target_dir, data, a.distill_steps * a.batch, a.seq, a.seed + 2)
        gen_seconds = time.time() - t0
        log(f"the target wrote {written.shape[0]} windows in {gen_seconds:.0f}s", a.log)
        distill_seconds = fit(head, target, written, a.distill_steps, a.batch,
                              lambda step: a.distill_lr * 0.5 * (1 + math.cos(math.pi * step / a.distill_steps)),
                              a.unroll, "distill", a)
    head.eval()
    with torch.no_grad():
        held_stats = [losses(head, target, held[i:i + 8], a.unroll)[1] for i in range(0, min(len(held), 64), 8)]
    held_mean = {k: sum(s[k] for s in held_stats) / len(held_stats) for k in held_stats[0]}
    export(head.state_dict(), target_dir, out, vocab_ids)
    stats = {"params": nparams, "steps": a.steps, "distill_steps": a.distill_steps, "batch": a.batch, "seq": a.seq,
             "lr": a.lr, "distill_lr": a.distill_lr, "seed": a.seed, "unroll": a.unroll, "threads": a.threads,
             "tokens_seen": (a.steps + a.distill_steps) * a.batch * a.seq, "draft_vocab": a.draft_vocab,
             "train_seconds": round(train_seconds, 1), "generate_seconds": round(gen_seconds, 1),
             "distill_seconds": round(distill_seconds, 1), "heldout_64_windows": held_mean,
             "torch": torch.__version__, "acceptance": [acceptance(target_dir, out, held_files, k) for k in (3, 4)]}
    stats["total_wall_seconds"] = round(time.time() - t_start, 1)
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    log(json.dumps(stats, indent=1), a.log)


if __name__ == "__main__":
    main()
