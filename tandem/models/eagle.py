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

A draft vocabulary (EAGLE-3's `d2t`, optional): the head drafts only among `draft_vocab_size` tokens
(config.json), the target ids `i + d2t[i]` of draft ids i (an int64 tensor `d2t` in the file; EAGLE-3's
`t2d` mask, if present, is redundant and ignored). Its logits are the target lm_head's rows of those tokens
only: on the shipped model the top 1024 of 4096 tokens cover 98% of the target's greedy tokens and cut
the head's lm_head by 4x. Verification is unchanged, so outputs are too; a target token outside the
draft vocabulary is just never drafted.
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
        self.draft_ids: torch.Tensor | None = None  # the draft vocabulary's target ids (see load_head)

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


def draft_vocabulary(path: str, weights: dict[str, torch.Tensor], target: ModelConfig) -> torch.Tensor | None:
    """The target token ids the head drafts among (ascending, int64), or None for the whole vocabulary;
    pops the draft-vocabulary tensors out of `weights`. A bad map is a ValueError naming it."""
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    with open(os.path.join(path, "config.json")) as f:
        size = json.load(f).get("draft_vocab_size")
    if d2t is None and size in (None, target.vocab_size):
        return None
    if d2t is None or d2t.dim() != 1 or d2t.is_floating_point() or len(d2t) != size:
        raise ValueError(f"EAGLE head {path!r}: draft_vocab_size {size} needs a 1-d integer tensor d2t of that "
                         f"many offsets, found {None if d2t is None else (tuple(d2t.shape), d2t.dtype)}")
    ids = torch.arange(len(d2t), dtype=torch.int64) + d2t.to(torch.int64)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size or bool((ids[1:] <= ids[:-1]).any())):
        raise ValueError(f"EAGLE head {path!r}: d2t must map draft ids to distinct target ids in ascending order "
                         f"within the target's {target.vocab_size}-token vocabulary")
    return ids


def load_head(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
              max_positions: int) -> EagleHead:
    """The head; `head.draft_ids` is its draft vocabulary (draft_vocabulary), or None."""
    cfg = head_config(path, target)
    head = EagleHead(cfg, max_positions)
    params = dict(head.named_parameters())
    weights = {k: v for k, v in read_weights(path, cfg).items() if not k.startswith(_SHARED)}
    head.draft_ids = draft_vocabulary(path, weights, target)
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(f"EAGLE head {path!r}: missing weights {missing[:8]}, unexpected {unexpected[:8]}")
    for name, tensor in weights.items():
        if tensor.shape != params[name].shape:
            raise ValueError(f"EAGLE head {path!r}: weight {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(params[name].shape)}")
    # assign=True: the head's parameters take the weights' dtype (a plain load_state_dict would copy
    # them into the fp32 parameters the module was built with, and a bf16 target would meet an fp32 fc).
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in weights.items()}, assign=True)
    return head.to(device).eval()


def rows_of(lm_head: Linear, ids: torch.Tensor) -> Linear:
    """A Linear over lm_head's output rows `ids` only (the same values: the same C plan applies)."""
    sub = Linear(lm_head.in_features, len(ids), bias=False, device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    sub.weight = torch.nn.Parameter(lm_head.weight.detach()[ids.to(lm_head.weight.device)].clone(), requires_grad=False)
    return sub
