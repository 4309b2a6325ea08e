"""An EAGLE draft head (Li et al., EAGLE-1): what it computes and how a checkpoint of it loads.

The head predicts the target's *next* final hidden state from the current one and the token that
followed it: at position p its input is fc(concat(embed(t[p+1]), f[p])), where f[p] is the target's
final (post-norm) hidden state at p; one or more Llama decoder layers (tandem's own `DecoderLayer`,
attending over the head's own paged cache) turn that into a prediction of f[p+1], and the target's
lm_head turns that into logits for t[p+2]. Embedding and lm_head are the target's, shared and never
copied, so a head is small: fc + its layers.

Checkpoint layout (vLLM's EAGLE naming): a directory with `config.json` (a Llama config whose
`architectures` names an EAGLE class, e.g. `EagleLlamaForCausalLM`; hidden and vocab sizes must be
the target's) and `model.safetensors` holding `fc.weight` [H, 2H] and `layers.N.*` with the usual
Llama names. As in vLLM, the first layer has no input_layernorm; an `embed_tokens`/`lm_head` copy
in the file (EAGLE-1 releases carry one) is ignored in favour of the target's.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from tandem.layers.attention import AttentionMetadata
from tandem.layers.linear import Linear
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ModelConfig
from tandem.models.llama import DecoderLayer
from tandem.models.loader import read_weights

_SHARED = ("embed_tokens.", "lm_head.", "model.embed_tokens.")  # the target's: never loaded from the head


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        # fc's output is a fresh mix of two normalised vectors: EAGLE skips the first layer's input norm.
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """embeds/features [T, H] -> the predicted next target hidden states [T, H]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        rope = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, meta)
        return x


def head_config(path: str, target: ModelConfig) -> ModelConfig:
    """The head's config, checked against the target's: a head for another model is a ValueError."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path!r} is not an EAGLE head checkpoint directory: config.json not found")
    with open(cfg_path) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not any("eagle" in a.lower() for a in archs):
        raise ValueError(f"{path!r} is not an EAGLE head (architectures {archs}; expected e.g. "
                         "EagleLlamaForCausalLM); for a full draft model use --speculator draft_model")
    cfg = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE head {path!r} has hidden_size {cfg.hidden_size} but the target model's hidden "
                         f"size is {target.hidden_size}: the head was trained for another model")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"EAGLE head {path!r} has vocab_size {cfg.vocab_size} but the target model's vocabulary "
                         f"has {target.vocab_size} tokens: the head was trained for another model")
    return cfg


def load_head(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
              max_positions: int) -> EagleHead:
    cfg = head_config(path, target)
    head = EagleHead(cfg, max_positions)
    params = dict(head.named_parameters())
    weights = {k: v for k, v in read_weights(path, cfg).items() if not k.startswith(_SHARED)}
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(f"EAGLE head {path!r}: missing weights {missing[:8]}, unexpected {unexpected[:8]}")
    for name, tensor in weights.items():
        if tensor.shape != params[name].shape:
            raise ValueError(f"EAGLE head {path!r}: weight {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(params[name].shape)}")
    head.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    return head.to(device).eval()
