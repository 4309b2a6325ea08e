"""Offline throughput: tandem `LLM.generate` vs transformers `generate`, and batch-1 decode vs the
memory-bandwidth limit, all measured in one run on the same random ~55M Llama.

    python -m bench.offline_throughput [--requests 64] [--seed 0]

(a) tandem: all requests in one `generate` call (continuous batching, chunked prefill).
(b) transformers the way a user runs it: batches of 16, left padding, each batch generating to its
    longest requested length; only the requested tokens are counted.
(c) the hardware limit for batch-1 decode: weight bytes / memory-copy bandwidth measured here.
On a GPU (the engine's default device there) transformers runs on it too, in the engine's dtype (bf16
unless --dtype says otherwise), and the copy bandwidth is the device's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BENCH_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                   initializer_range=0.02)


def build_model(path: str) -> None:
    import transformers as tf
    from tiny_models import write_tokenizer

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**BENCH_MODEL, bos_token_id=0, eos_token_id=1))
    model.save_pretrained(path)
    write_tokenizer(path)


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 32000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256)) for _ in range(n)]


def memcpy_gbps(device: torch.device = torch.device("cpu")) -> float:
    src = torch.empty((1 << 30 if device.type == "cuda" else 256 << 20) // 4, dtype=torch.float32,
                      device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(8):
        torch.cuda.synchronize() if device.type == "cuda" else None
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize() if device.type == "cuda" else None
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best / 1e9  # bytes read once, written once: count the payload, as memcpy does


def run_tandem(path: str, work, dtype: str = "auto") -> tuple[float, int]:
    from tandem import LLM, SamplingParams

    llm = LLM(path, max_model_len=1024, kv_cache_memory_gb=2.0, max_num_seqs=64, max_num_batched_tokens=2048,
              dtype=dtype)
    llm.generate([[5] * 64], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t
    assert [len(o.token_ids) for o in outs] == [o for _, o in work]
    return dt, sum(o for _, o in work)


def run_transformers(path: str, work, device: torch.device, dtype: torch.dtype, batch: int = 16
                     ) -> tuple[float, int]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    t = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(work), batch):
            chunk = work[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[2] * (width - len(p)) + p for p, _ in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
            longest = max(o for _, o in chunk)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=2, eos_token_id=None)
    return time.perf_counter() - t, sum(o for _, o in work)


def batch1_decode(path: str, dtype: str = "auto", steps: int = 128) -> float:
    """Decode tokens/s of one request after its prompt (prefill time excluded)."""
    from tandem import SamplingParams
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=path, max_model_len=1024, kv_cache_memory_gb=0.5, dtype=dtype))
    # Warm-up: the first steps of a fresh process pay for page faults and allocator growth.
    engine.add_request("warm", [5] * 32, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b1", [7] * 32, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # prefill + first token
    t = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests():
        n += len(engine.step()[0].new_token_ids)
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--dtype", default="auto", help="the engine's (and transformers') dtype; auto: fp32 on CPU, "
                                                    "bf16 on a GPU")
    args = ap.parse_args()
    from tandem.config import EngineConfig

    config = EngineConfig(model="", dtype=args.dtype)
    device, dtype = config.torch_device, config.torch_dtype
    path = tempfile.mkdtemp(prefix="tandem-bench-")
    build_model(path)
    work = workload(args.requests, args.seed)
    weight_bytes = sum(p.numel() * dtype.itemsize for p in __import__("safetensors.torch").torch.load_file(
        os.path.join(path, "model.safetensors")).values())
    bw = memcpy_gbps(device)
    limit = bw * 1e9 / weight_bytes
    b1 = batch1_decode(path, args.dtype)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"threads={torch.get_num_threads()}"
    print(f"{where} {dtype} weights={weight_bytes / 1e6:.0f} MB memcpy={bw:.1f} GB/s")
    print(f"(c) batch-1 decode limit (weights / memcpy): {limit:.1f} tok/s")
    print(f"    tandem batch-1 decode: {b1:.1f} tok/s = {b1 / limit:.0%} of the limit (target >= 70%)")
    dt_a, tok = run_tandem(path, work, args.dtype)
    print(f"(a) tandem LLM.generate: {tok} tokens in {dt_a:.1f} s = {tok / dt_a:.1f} tok/s")
    if not args.skip_transformers:
        dt_b, _ = run_transformers(path, work, device, dtype)
        print(f"(b) transformers generate (batch 16, left pad): {tok / dt_b:.1f} tok/s")
        print(f"    ratio a/b = {dt_b / dt_a:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
