"""The minimal Llama that tools/train_tiny.py trains (and tools/train_eagle.py builds its head from).

RMSNorm, RoPE, GQA, SwiGLU, tied embeddings: parameter names are the Hugging Face
`LlamaForCausalLM` names and the math is transformers' own, so an export is a dtype cast and
transformers reproduces its held-out loss (train_tiny's verify step checks that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Cfg:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(cfg: Cfg, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Same inv_freq expression as transformers' default rope; half-split (rotate_half) layout.
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    f = torch.outer(torch.arange(n).float(), inv)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Layer(nn.Module):
    """Pre-norm GQA attention with RoPE, then pre-norm SwiGLU MLP (HF LlamaDecoderLayer)."""

    def __init__(self, c: Cfg) -> None:
        super().__init__()
        hid, h, kv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.h, self.kv, self.d = h, kv, d
        # ModuleDicts give the exact HF parameter names (self_attn.q_proj.weight, mlp.up_proj...).
        self.input_layernorm = RMSNorm(hid, c.rms_norm_eps)
        self.self_attn = nn.ModuleDict({"q_proj": _linear(hid, h * d), "k_proj": _linear(hid, kv * d),
                                        "v_proj": _linear(hid, kv * d), "o_proj": _linear(h * d, hid)})
        self.post_attention_layernorm = RMSNorm(hid, c.rms_norm_eps)
        inter = c.intermediate_size
        self.mlp = nn.ModuleDict({"gate_proj": _linear(hid, inter), "up_proj": _linear(hid, inter),
                                  "down_proj": _linear(inter, hid)})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        (b, t, _), a, m = x.shape, self.self_attn, self.mlp
        y = self.input_layernorm(x)
        q = a["q_proj"](y).view(b, t, self.h, self.d).transpose(1, 2)
        k = a["k_proj"](y).view(b, t, self.kv, self.d).transpose(1, 2)
        v = a["v_proj"](y).view(b, t, self.kv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # GQA: query head i reads kv head i // (h // kv), exactly transformers' repeat_kv.
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + a["o_proj"](o.transpose(1, 2).reshape(b, t, self.h * self.d))
        y = self.post_attention_layernorm(x)
        return x + m["down_proj"](F.silu(m["gate_proj"](y)) * m["up_proj"](y))


class TinyLlama(nn.Module):
    """Parameter names equal HF LlamaForCausalLM's, so export is a dtype cast (lm_head tied)."""

    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.cfg = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # residual-output projections scaled down (GPT-2 style) for stability
                deep = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * c.num_hidden_layers) if deep else 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.cfg, ids.shape[1])
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.model.embed_tokens.weight.T

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token NLL over the window, the same reduction as HF `labels=input_ids`."""
        logits = self(ids)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
