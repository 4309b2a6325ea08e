"""Decode worker: the engine in decode role + KV receiver; streams tokens to whoever added a request."""
