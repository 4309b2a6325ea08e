"""The engine's KV cache described as a `kvtransfer.CacheLayout`, and connector wiring for workers.

Both halves of a transfer describe their cache this way; the handshake refuses a mismatch. The
model is identified by architecture + a digest of config.json, so two hosts holding the same
checkpoint at different paths still agree.
"""

from __future__ import annotations

import hashlib
import os

from kvtransfer import CacheLayout, KVReceiver, KVSender
from plugins.registry import resolve_connector
from tandem.engine.llm_engine import LLMEngine


def model_identity(path: str) -> str:
    with open(os.path.join(path, "config.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return f"{os.path.basename(os.path.normpath(path))}@{digest}"


def cache_layout(engine: LLMEngine) -> CacheLayout:
    cfg = engine.model_config
    cache = engine.runner.kv_caches[0]
    return CacheLayout(
        model=model_identity(engine.config.model),
        dtype=str(engine.config.torch_dtype).removeprefix("torch."),
        kv_cache_dtype=str(cache.dtype).removeprefix("torch."),
        block_size=engine.config.block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )


def attach_receiver(engine: LLMEngine, connector: str, bind: str, timeout_s: float = 30.0) -> KVReceiver:
    """Decode side: place the cache where the connector wants it (shm: shared memory) and listen."""
    conn = resolve_connector(connector)(timeout_s=timeout_s)
    layout = cache_layout(engine)
    caches, scales = conn.allocate_kv_caches(layout, engine.num_kv_blocks, engine.config.torch_device)
    engine.runner.kv_caches, engine.runner.kv_scales = caches, scales
    return conn.make_receiver(layout, caches, scales, bind=bind)


def make_sender(engine: LLMEngine, connector: str) -> KVSender:
    conn = resolve_connector(connector)()
    return conn.make_sender(cache_layout(engine), engine.config.torch_device)
