"""Prefill worker: the engine in prefill role + KV sender (layer-wise push to decode workers)."""
