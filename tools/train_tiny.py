"""Train and export tandem's shipped tiny model pair: `tiny-target` and `tiny-draft`.

This file owns the whole recipe, end to end:
  1. corpus   - the running interpreter's standard library *.py files (sorted; site-packages
                and test directories excluded); every file whose sorted index % 50 == 0 is held out.
  2. tokenizer- a byte-level BPE (HF `tokenizers`) trained on the training files only.
  3. model    - a minimal Llama (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) whose parameter
                names *are* the Hugging Face `LlamaForCausalLM` names and whose math is the same
                (tools/tiny_llama.py).
  4. training - AdamW, linear warmup + cosine decay, fp32 on CPU, fixed seeds and batch order.
  5. export   - bf16 safetensors + config/tokenizer/generation files into tandem/assets/<name>/.
  6. verify   - transformers loads each export; its held-out loss must equal ours; greedy samples.
Numbers for the model card land in tandem/assets/train_stats.json.

Reproducibility: fixed seeds, file order and batch order, and fixed step counts by default, so a
rerun on the same interpreter and torch gives bit-identical files. With `--*-minutes` the step count
is instead calibrated from the time budget during warmup (the warmup lr does not depend on it) and
logged; rerunning with that count as `--*-steps` reproduces such a run without depending on timing.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tiny_llama import Cfg, TinyLlama

ASSETS = Path(__file__).resolve().parent.parent / "tandem" / "assets"
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS, PAD = 0, 1, 2  # ids follow SPECIALS order: the trainer adds special tokens first
# Role-tagged turns, each closed by eos so a plain eos stop ends an assistant reply.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
HELDOUT_EVERY = 50


def log(msg: str, path: str | None = None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------- corpus and tokenizer
def corpus() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, heldout) lists of (relative path, text), deterministic for a given interpreter."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    train, held = [], []
    for i, rel in enumerate(files):
        try:  # a few stdlib files are deliberately not UTF-8; they are skipped, not guessed at
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        (held if i % HELDOUT_EVERY == 0 else train).append((rel, text))
    return train, held


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Llama convention: encoding text prepends bos (the chat template adds its own bos and
    # transformers tokenizes templates without special tokens, so there is never a double bos).
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B:1", special_tokens=[("<|bos|>", BOS)])
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    return tok


def to_windows(tok, texts: list[str], seq: int) -> torch.Tensor:
    """Concatenate `bos + file + eos` for every file and cut into non-overlapping windows."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += [BOS, *enc.ids, EOS]
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq], dtype=torch.long).view(n, seq)


# ---------------------------------------------------------------- training
@torch.no_grad()
def eval_loss(model: TinyLlama, windows: torch.Tensor, bs: int = 16) -> float:
    model.eval()
    tot = sum(model.loss(windows[i:i + bs]).item() * len(windows[i:i + bs])
              for i in range(0, len(windows), bs))
    model.train()
    return tot / len(windows)


# ---------------------------------------------------------------- training
def train(name: str, cfg: Cfg, data: torch.Tensor, held: torch.Tensor, a: argparse.Namespace,
          minutes: float, steps: int | None, lr: float) -> tuple[TinyLlama, dict]:
    torch.manual_seed(a.seed)
    model = TinyLlama(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    log(f"{name}: {nparams:,} params, cfg {asdict(cfg)}", a.log)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    order = torch.Generator().manual_seed(a.seed + 1)
    perm, cursor = torch.randperm(len(data), generator=order), 0
    total, t0, calib_t = steps, time.time(), 0.0
    probe = held[: a.probe_windows]
    step, losses = 0, []
    while total is None or step < total:
        if step == 5:
            calib_t = time.time()
        if total is None and step == a.warmup:  # calibrate the budget from steps 5..warmup
            per = (time.time() - calib_t) / (a.warmup - 5)
            total = max(a.warmup + 1, int((minutes * 60 - (time.time() - t0)) / per) + step)
            log(f"{name}: {per:.3f}s/step -> total steps fixed at {total}", a.log)
        cur = total or 10**9
        lr_now = lr * (step + 1) / a.warmup if step < a.warmup else \
            lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - a.warmup) / max(1, cur - a.warmup))))
        for g in opt.param_groups:
            g["lr"] = lr_now
        if cursor + a.batch > len(perm):  # next epoch, still a fixed order
            perm, cursor = torch.randperm(len(data), generator=order), 0
        batch = data[perm[cursor:cursor + a.batch]]
        cursor += a.batch
        loss = model.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % a.log_every == 0 or step == total:
            recent = losses[-a.log_every:]
            msg = f"{name} step {step}/{total} lr {lr_now:.2e} train {sum(recent) / len(recent):.4f}"
            if step % (a.log_every * 5) == 0 or step == total:
                msg += f" heldout-probe {eval_loss(model, probe):.4f}"
            log(msg + f" elapsed {time.time() - t0:.0f}s", a.log)
    tail = losses[-max(1, min(50, len(losses))):]
    stats = {"params": nparams, "config": asdict(cfg), "steps": step, "batch": a.batch,
             "seq_len": a.seq, "tokens_seen": step * a.batch * a.seq, "peak_lr": lr,
             "train_seconds": round(time.time() - t0, 1), "final_train_loss_last50": sum(tail) / len(tail),
             "epochs": round(step * a.batch / len(data), 3)}
    return model, stats


# ---------------------------------------------------------------- export and verification
def export(model: TinyLlama, tok, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(c),
           "head_dim": c.head_dim, "hidden_act": "silu", "attention_bias": False,
           "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True,
           "initializer_range": 0.02, "rope_scaling": None, "use_cache": True,
           "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
           "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[BOS],
            "eos_token": SPECIALS[EOS], "pad_token": SPECIALS[PAD], "add_bos_token": True,
            "add_eos_token": False, "model_max_length": c.max_position_embeddings,
            "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")


def reload_bf16(model: TinyLlama, out: Path) -> TinyLlama:
    """Our model with exactly the shipped (bf16-rounded) weights, computed in fp32."""
    from safetensors.torch import load_file

    m = TinyLlama(model.cfg)
    m.load_state_dict({k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()})
    return m


@torch.no_grad()
def verify(model: TinyLlama, out: Path, held: torch.Tensor, prompts: list[str]) -> dict:
    """transformers is the oracle: it must load the export and reproduce our held-out loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tk = AutoTokenizer.from_pretrained(str(out))
    hf_tot = sum(hf(input_ids=held[i:i + 16], labels=held[i:i + 16]).loss.item() * len(held[i:i + 16])
                 for i in range(0, len(held), 16)) / len(held)
    ours = eval_loss(reload_bf16(model, out), held)
    if abs(hf_tot - ours) > 1e-4:
        raise RuntimeError(f"loss parity failed: transformers {hf_tot} vs ours {ours}")
    samples = {}
    for p in prompts:
        ids = tk(p, return_tensors="pt").input_ids
        g = hf.generate(ids, max_new_tokens=64, do_sample=False)
        samples[p] = tk.decode(g[0, ids.shape[1]:], skip_special_tokens=False)
    return {"heldout_loss_transformers": hf_tot, "heldout_loss_ours": ours,
            "heldout_ppl_transformers": math.exp(hf_tot), "heldout_tokens_scored":
            held.numel() - len(held), "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Fixed step counts by default: identical weights on every run, however loaded the machine is
    # (~33 + ~5 minutes on one idle core of the reference box). Minutes budget by time instead.
    ap.add_argument("--target-steps", type=int, default=1750, help="training steps of the target")
    ap.add_argument("--draft-steps", type=int, default=1400, help="training steps of the draft")
    ap.add_argument("--target-minutes", type=float, default=None, help="time budget (replaces steps)")
    ap.add_argument("--draft-minutes", type=float, default=None, help="time budget (replaces steps)")
    ap.add_argument("--threads", type=int, default=1, help="torch/tokenizers threads (shared box: 1)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--probe-windows", type=int, default=32, help="held-out windows probed while training")
    ap.add_argument("--out", type=Path, default=ASSETS, help="assets dir (tiny-target/, tiny-draft/)")
    ap.add_argument("--log", default="/tmp/train_tiny.log")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)  # tokenizers' thread pool, read on first use
    t_start = time.time()
    train_files, held_files = corpus()
    digest = hashlib.sha256("".join(r + t for r, t in train_files + held_files).encode()).hexdigest()
    log(f"corpus: {len(train_files)} train / {len(held_files)} held-out files, sha256 {digest[:16]}", a.log)
    tok = train_tokenizer([t for _, t in train_files], a.vocab)
    data = to_windows(tok, [t for _, t in train_files], a.seq)
    held = to_windows(tok, [t for _, t in held_files], a.seq)
    log(f"tokenizer vocab {tok.get_vocab_size()}; {data.numel():,} train / {held.numel():,} held-out tokens", a.log)
    stats: dict = {"python_stdlib": sysconfig.get_paths()["stdlib"], "corpus_sha256": digest,
                   "train_files": len(train_files), "heldout_files": [r for r, _ in held_files],
                   "train_tokens": data.numel(), "heldout_tokens": held.numel(), "args": {
                       k: str(v) for k, v in vars(a).items()}, "torch": torch.__version__}
    # Prompts end on a token boundary (no trailing whitespace), as real code prompts do.
    prompts = ['def fibonacci(n):\n    """Return the nth Fibonacci number."""',
               "import os\nimport sys\n\n\nclass Config", "    def __init__(self"]
    specs = [("tiny-target", Cfg(a.vocab, 256, 6, 8, 4, 688), a.target_minutes, a.target_steps, 2e-3),
             ("tiny-draft", Cfg(a.vocab, 128, 2, 4, 2, 344), a.draft_minutes, a.draft_steps, 3e-3)]
    for name, cfg, minutes, steps, lr in specs:
        steps = None if minutes is not None else steps
        model, st = train(name, cfg, data, held, a, minutes, steps, lr)
        st["heldout_loss_fp32_weights"] = eval_loss(model, held)
        export(model, tok, a.out / name)
        st.update(verify(model, a.out / name, held, prompts))
        log(f"{name}: {json.dumps(st, indent=1)}", a.log)
        stats[name] = st
    stats["total_wall_seconds"] = round(time.time() - t_start, 1)
    (a.out / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    log(f"done in {stats['total_wall_seconds']}s", a.log)


if __name__ == "__main__":
    main()
