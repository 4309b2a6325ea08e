"""Benchmarks: run as modules from the repo root, e.g. `python -m bench.offline_throughput`
(running a file directly would put bench/ first on sys.path, where bench/kernels.py shadows kernels/)."""
