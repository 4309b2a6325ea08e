"""P:D planning: profiles of measured step times (`profile`, measured by `measure`), workloads
(`workload`), a discrete-event cluster simulator (`simulator`) and the split search (`planner`).
Only `measure` imports torch and the engine; the rest is plain Python, so planning runs anywhere."""
