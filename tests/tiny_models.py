"""Build tiny random Hugging Face checkpoints (4 architectures) + a trained byte-level BPE tokenizer.

transformers is the oracle: it creates and saves the weights with `save_pretrained`, so tandem
loads exactly what a user's checkpoint directory holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

VOCAB = 512
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_lines(limit: int = 4000) -> list[str]:
    """Deterministic text every machine has: a few stdlib modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in ("textwrap.py", "heapq.py", "bisect.py", "colorsys.py", "shlex.py"):
        lines.extend((stdlib / name).read_text(encoding="utf-8").splitlines())
    return (lines + ["héllo wörld — ünïcode ✓ 日本語 テキスト 😀"] * 20)[:limit]


def write_tokenizer(path: str, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
           "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)


def make_checkpoint(path: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Save a tiny random model of `arch` (llama | llama3 | mistral | qwen2 | qwen3) to `path`."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=0, eos_token_id=1, initializer_range=0.1)
    kinds = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "llama3": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
            tie_word_embeddings=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=None)),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32)),  # head_dim != hidden/heads
    }
    config_cls, model_cls, extra = kinds[arch]
    config = config_cls(**{**common, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch == "qwen2":  # random biases so a dropped bias would show up
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, **generate_options) -> list[list[int]]:
    """transformers greedy continuation of each prompt (one at a time: no padding effects); generate_options
    override the checkpoint's generation_config (e.g. repetition_penalty=1.0)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0, **generate_options)
            outs.append(gen[0, len(p):].tolist())
    return outs


def make_eagle_head(path: str, target: str, seed: int = 0, scale: float = 0.1,
                    draft_ids: list[int] | None = None, **overrides) -> str:
    """A random EAGLE head (vLLM names: fc.weight, layers.0.*; no input_layernorm) for the target
    checkpoint at `target`; `overrides` change its config (e.g. a wrong hidden_size). draft_ids: a draft
    vocabulary (EAGLE-3's d2t offsets and draft_vocab_size) of those target ids."""
    from safetensors.torch import save_file

    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1, **overrides)
    hid, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg.get("head_dim") or hid // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    attn, mlp = "layers.0.self_attn.", "layers.0.mlp."
    weights = {"fc.weight": rand(hid, 2 * hid), attn + "q_proj.weight": rand(heads * dim, hid),
               attn + "k_proj.weight": rand(kv * dim, hid), attn + "v_proj.weight": rand(kv * dim, hid),
               attn + "o_proj.weight": rand(hid, heads * dim),
               "layers.0.post_attention_layernorm.weight": torch.ones(hid),
               mlp + "gate_proj.weight": rand(inter, hid), mlp + "up_proj.weight": rand(inter, hid),
               mlp + "down_proj.weight": rand(hid, inter)}
    if draft_ids is not None:
        cfg.setdefault("draft_vocab_size", len(draft_ids))
        weights["d2t"] = torch.tensor(draft_ids, dtype=torch.int64) - torch.arange(len(draft_ids))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(weights, os.path.join(path, "model.safetensors"))
    return path


def assert_cli_refuses(target: str, head: str, needle: str) -> None:
    """`tandem generate` with that EAGLE head exits 2 with one line that says `needle`."""
    cmd = [sys.executable, "-m", "tandem.cli", "generate", "--model", target, "--speculator", "eagle",
           "--draft-model", head, "--num-kv-blocks", "64", "hi"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr


def set_chat_template(path: str, template: str) -> str:
    """Give the checkpoint at `path` this chat template (its tokenizer_config.json); returns `path`."""
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({**cfg, "chat_template": template}, f)
    return path


def heldout_code() -> list[str]:
    """Snippets of standard-library files tools/train_tiny.py held out (never trained on)."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in ("optparse.py", "sre_parse.py", "asyncio/tasks.py", "wsgiref/validate.py"):
        text = (root / name).read_text(encoding="utf-8")
        start = text.find("\ndef ", len(text) // 3)
        out.append(text[start + 1:start + 500])
    return out
