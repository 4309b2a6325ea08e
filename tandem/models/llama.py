"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3): one implementation, switched by ModelConfig.

Tokens of a step are packed flat ([T, hidden], no padding); attention reads/writes the paged cache
through AttentionMetadata. q/k/v and gate/up are fused projections (the loader concatenates the
checkpoint's separate weights).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused
from tandem.layers import fused_decode, fused_model
from tandem.layers.attention import Attention, AttentionMetadata
from tandem.layers.linear import Linear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                out_rows_only: bool = False) -> torch.Tensor:
        if out_rows_only:  # the last layer of a step with prompt rows that do not sample (AttentionMetadata)
            h = self.self_attn(self.input_layernorm(x), rope, meta, out_rows_only=True)
            assert meta.out_rows is not None
            if not len(h):
                return h
            x, h = self.post_attention_layernorm.add_forward(x.index_select(0, meta.out_rows), h)
            return x + self.mlp(h)
        if x.shape[0] <= fused_decode.MAX_ROWS:  # a small decode step: the whole layer in one C call
            out = fused_decode.run(self, x, rope, meta)
            if out is not None:
                return out
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), rope, meta))
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        if len(x) <= fused_decode.MAX_ROWS and meta.out_rows is None:  # a small decode step: all layers in one C call
            out = fused_decode.run_layers(self.layers, x, rope, meta)
            if out is not None:
                return self.norm(out)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, meta, out_rows_only=i == last and meta.out_rows is not None)
        return self.norm(x) if len(x) else x


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._fused_logits: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None  # see forward
        self.fused_argmax: tuple[torch.Tensor, list[int]] | None = None  # see compute_logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; call `compute_logits` on the rows you sample from. A small
        decode step runs body and lm_head in one C call (fused_model.run_model): its logits are kept for the
        compute_logits of the very tensor returned."""
        self._fused_logits = self.fused_argmax = None
        if len(input_ids) <= fused_decode.MAX_ROWS and meta.out_rows is None:
            fused = fused_model.run_model(self.model, input_ids, positions, meta, self.lm_head)
            if fused is not None:
                hidden, logits, best = fused
                if logits is not None:
                    self._fused_logits = (hidden, logits, best)
                return hidden
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits of `hidden`; those of the tensor forward just returned come from its C call,
        with their argmax kept in `fused_argmax` ((logits, each row's argmax)) for the greedy sampler."""
        held = self._fused_logits
        if held is not None and held[0] is hidden:
            self._fused_logits = None  # taken once: not kept alive past the step
            self.fused_argmax = held[1:]
            return held[1]
        return self.lm_head(hidden).float()
