"""Wire formats: the msgpack control messages between router, decode and prefill workers."""
