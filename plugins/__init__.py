"""Pluggable strategies (eviction, KV quantization, speculation, connectors, routing) and their registry."""
