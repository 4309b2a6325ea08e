"""Where tandem's shipped tiny model pair lives.

tandem ships a small Llama-architecture target and a smaller draft that share one tokenizer,
trained by `tools/train_tiny.py` on the Python standard library and described in
`tandem/assets/MODEL_CARD.md`. They live as ordinary Hugging Face checkpoint directories inside
the package, so `LLM()` works offline and out of the box and speculative decoding has a real
draft to measure. This module only resolves their paths; it imports nothing heavy.
"""
from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TARGET_NAME = "tiny-target"
DRAFT_NAME = "tiny-draft"
EAGLE_NAME = "tiny-eagle"  # an EAGLE head trained on tiny-target's hidden states (tools/train_eagle.py)
# A checkpoint directory is only usable with all of these; checking them gives a clear error
# up front instead of a confusing failure deep inside the loader.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
HEAD_FILES = ("config.json", "model.safetensors")  # a head uses the target's tokenizer


def _asset_dir(name: str, required: tuple[str, ...] = REQUIRED_FILES) -> str:
    path = ASSETS_DIR / name
    missing = [f for f in required if not (path / f).is_file()]
    if missing:
        raise ValueError(  # a ValueError: the CLI reports it as one line, exit 2
            f"tandem's packaged model {name!r} is missing {missing} under {path}. "
            "Reinstall tandem-llm, or regenerate the assets with `python tools/train_tiny.py` "
            "(the EAGLE head: `python tools/train_eagle.py`), "
            "or pass an explicit model directory instead of relying on the default.")
    return str(path)


def default_model_path() -> str:
    """Directory of the packaged target model (a Hugging Face Llama checkpoint)."""
    return _asset_dir(TARGET_NAME)


def default_draft_path() -> str:
    """Directory of the packaged draft model; same tokenizer as the target, for speculation."""
    return _asset_dir(DRAFT_NAME)


def default_eagle_path() -> str:
    """Directory of the packaged EAGLE head for the packaged target (`--speculator eagle`)."""
    return _asset_dir(EAGLE_NAME, HEAD_FILES)
