"""The engine every role runs: request, scheduler, KV cache manager, model runner, sampler."""
