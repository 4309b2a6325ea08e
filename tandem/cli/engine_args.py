"""Engine options as CLI flags, derived from EngineConfig's fields so the two never drift apart: the parser's
arguments, the config built from them, the model path they name, and the flags `tandem up` and `tandem launch`
forward to their workers."""

from __future__ import annotations

import argparse
import dataclasses
import os
from functools import lru_cache

from tandem.config import EngineConfig

_HELP = {
    "dtype": "weights/activations dtype: auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16",
    "num_kv_blocks": "number of KV cache blocks (overrides --kv-cache-memory-gb)",
    "kv_cache_memory_gb": "memory for the KV cache in GiB",
    "kv_cache_dtype": "KV cache storage: auto | fp8_e4m3 | int8",
    "max_model_len": "longest sequence (prompt + output) in tokens",
    "eviction": "prefix-cache eviction policy (see `tandem plugins`)",
    "speculator": "speculative decoding: ngram | draft_model | eagle | a plugin's name (default: off)",
    "num_speculative_tokens": "tokens proposed per step when speculating (1-15)",
    "draft_model": ("draft checkpoint for --speculator draft_model, or EAGLE head directory for --speculator eagle "
                    "(default: the built-in draft model / head)"),
    "spec_max_batch": "speculate only while at most this many requests are running (default: 1 on a CPU, 8 on a GPU)",
    "enforce_eager": "GPU: run every decode step eagerly instead of replaying CUDA graphs (no effect on CPU)",
    "max_num_seqs": "most requests in one continuous batch",
    "max_num_batched_tokens": "token budget of one step (chunked-prefill chunk size)",
    "role": "engine role",
}
_SKIP = {"model", "role"}
_RENAMED = {"seed": "engine_seed"}  # `--seed` is the per-request sampling seed on every command


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        dest = _RENAMED.get(f.name, f.name)
        flag = "--" + dest.replace("_", "-")
        if f.type in ("bool", bool):
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=f.default,
                               help=_HELP.get(f.name))
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        text = _HELP.get(f.name, "")
        if f.default is not None and "default:" not in text:  # as vLLM's --help shows them (bools: argparse does)
            text = f"{text} (default: %(default)s)".strip()
        group.add_argument(flag, dest=dest, type=kind, default=f.default, help=text or None)


def engine_config_from_args(args: argparse.Namespace, model: str, role: str = "both") -> EngineConfig:
    values = {f.name: getattr(args, _RENAMED.get(f.name, f.name))
              for f in dataclasses.fields(EngineConfig) if f.name not in _SKIP}
    return EngineConfig(model=model, role=role, **values)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face checkpoint directory (default: the built-in tiny model shipped with tandem)")


def resolve_model(path: str | None) -> str:
    if path is not None:
        return path
    from tandem.default_model import default_model_path

    return default_model_path()


@lru_cache(maxsize=1)
def engine_actions() -> dict[str, argparse.Action]:
    """The engine flags every worker takes, by dest (what `add_engine_args` defines)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    return {a.dest: a for a in probe._actions}


def engine_flags(values: dict) -> list[str]:
    """Worker flags for the engine options in `values` (by dest) that differ from the defaults."""
    flags: list[str] = []
    for dest, action in engine_actions().items():
        value = values.get(dest, action.default)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(action.option_strings[0] if value else action.option_strings[1])
        else:
            flags += [action.option_strings[0], str(value)]
    return flags


def resolve_model_path(path: str | None) -> str:
    """An existing local checkpoint directory (the built-in model when `path` is None)."""
    try:
        resolved = resolve_model(path)
    except FileNotFoundError as exc:  # the default model is missing: say so as bad input, not a traceback
        raise ValueError(str(exc)) from None
    if not os.path.isdir(resolved):
        raise ValueError(f"--model {path}: no such checkpoint directory")
    return os.path.abspath(resolved)
