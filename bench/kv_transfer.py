"""KV transfer throughput: each connector moving one request's KV between two processes, against a
plain memory copy (torch `copy_`) of the same bytes measured in the same run.

Default workload: the benchmark model (8 layers, 2 KV heads, head dim 64, fp32 cache, block 16)
and a 2k-token prompt, i.e. 128 blocks x 8 layers = 16 MiB per transfer. One transfer = send_layer
for every layer + D's acknowledgement (so it includes D writing its cache). The sender lends its
blocks (`borrow=True`), as a prefill worker does for a prompt's last chunk: zmq sends them without a
copy. "one-at-a-time" waits for each acknowledgement (latency), timed to the moment the sender learns of it (its
finish Future's callback, where a prefill worker frees the blocks); a thread blocked in finish() is scheduled a
little later, printed beside it. "streamed" sends transfers back to back and collects the acknowledgements at
the end (throughput, as a busy prefill worker would).

    python bench/kv_transfer.py [--tokens 2048] [--iters 20] [--fragmented] [--connectors zmq-tcp,shm]

With TANDEM_LINK_SECRET (or TANDEM_LINK_KEYS) exported, both ends run their links under ZMQ CURVE,
as a cluster with link keys does: that measures the cost of authenticated, encrypted links.

Targets: shm >= 80% of memcpy, zmq tcp >= 80% of the raw TCP socket (bench/raw_tcp.py) measured in the
same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.raw_tcp import raw_tcp_times  # noqa: E402
from kvtransfer import CONNECTORS, CacheLayout, TransferDone, TransferFailed  # noqa: E402
from tandem.protocol import security  # noqa: E402

LAYOUT = CacheLayout("bench", "float32", "float32", block_size=16, num_layers=8, num_kv_heads=2, head_dim=64)
VARIANTS = {  # name -> (connector, bind)
    "zmq-tcp": ("zmq", "tcp://127.0.0.1:*"),
    "zmq-ipc": ("zmq", None),  # filled in per run with a fresh ipc path
    "shm": ("shm", None),
    "torch_dist": ("torch_dist", "tcp://127.0.0.1:*"),
}


def block_ids(n: int, fragmented: bool, offset: int) -> list[int]:
    if not fragmented:
        return list(range(offset, offset + n))
    g = torch.Generator().manual_seed(offset)
    return (torch.randperm(2 * n, generator=g)[:n] + offset).tolist()


def receiver_main(connector: str, bind: str | None, n_blocks: int, n_requests: int, fragmented: bool, conn) -> None:
    torch.set_num_threads(1)
    c = CONNECTORS[connector](timeout_s=600)
    caches, scales = c.allocate_kv_caches(LAYOUT, 3 * n_blocks + 8)
    security.configure_from_options()  # the environment's link keys, if any (spawned: nothing inherited)
    rx = c.make_receiver(LAYOUT, caches, scales, bind)
    dest = block_ids(n_blocks, fragmented, offset=n_blocks)
    for i in range(n_requests):
        rx.expect(f"req-{i}", dest)
    conn.send((rx.address, dest))
    finished = 0
    while finished < n_requests:
        for ev in rx.poll(100):
            if isinstance(ev, (TransferDone, TransferFailed)):
                finished += 1
                if isinstance(ev, TransferFailed):
                    print("transfer failed:", ev, file=sys.stderr)
    conn.send("done")
    conn.recv()
    rx.close()
    c.free_kv_caches(caches)  # spawned children skip atexit, where the shm file would go otherwise


def sender_main(connector: str, n_blocks: int, n_requests: int, warmup: int, fragmented: bool, address: str,
                dest: list[int], conn) -> None:
    """One at a time (send every layer, wait for D's ack) for `n_requests`, then the same count
    streamed: every request's layers back to back, acks collected at the end (finish_async)."""
    torch.set_num_threads(1)
    security.configure_from_options()
    tx = CONNECTORS[connector]().make_sender(LAYOUT, "cpu")
    cache = torch.randn(2 * n_blocks + 8, *LAYOUT.block_shape)
    src = block_ids(n_blocks, fragmented, offset=0)
    tx.connect(address)

    def send(i: int) -> None:
        for layer in range(LAYOUT.num_layers):
            tx.send_layer(address, f"req-{i}", layer, cache, None, src, dest, borrow=True)  # as P's last chunk

    # The reference copy runs here, between transfers: this VM's memory bandwidth drifts by 2x within
    # minutes, so a memcpy timed in another process at another moment makes a noisy denominator.
    copies = [torch.randn(n_blocks * LAYOUT.block_nbytes * LAYOUT.num_layers // 4) for _ in range(2)]
    memcpy: list[float] = []

    def time_memcpy() -> None:
        t0 = time.perf_counter()
        copies[1].copy_(copies[0])
        memcpy.append(time.perf_counter() - t0)

    latencies, woken = [], []
    for i in range(n_requests):
        time_memcpy()
        acked: list[float] = []
        t0 = time.perf_counter()
        send(i)
        fut = tx.finish_async(f"req-{i}")
        fut.add_done_callback(lambda _: acked.append(time.perf_counter()))  # runs where the ack is read
        ok = fut.result(timeout=60)
        woken.append(time.perf_counter() - t0)
        while not acked:  # result() can return before the I/O thread has run the callbacks
            time.sleep(0)
        latencies.append(acked[0] - t0)
        if not ok:
            print(f"req-{i} not acknowledged", file=sys.stderr)
    for _ in range(n_requests):
        time_memcpy()
    t0 = time.perf_counter()
    futures = []
    for i in range(n_requests, 2 * n_requests):
        send(i)
        futures.append(tx.finish_async(f"req-{i}"))
    acked = sum(f.result(timeout=120) for f in futures)
    streamed = (time.perf_counter() - t0) / n_requests
    if acked != n_requests:
        print(f"streamed: {n_requests - acked} not acknowledged", file=sys.stderr)
    conn.send((latencies[warmup:], streamed, memcpy[warmup:], woken[warmup:]))
    tx.close()


def run_connector(variant: str, n_blocks: int, iters: int, warmup: int, fragmented: bool
                  ) -> tuple[float, float, float, float]:
    """(median one-at-a-time seconds, streamed seconds per transfer, median memcpy seconds timed in
    the sender between transfers, median one-at-a-time until a thread blocked in finish() runs) between
    two fresh processes."""
    connector, bind = VARIANTS[variant]
    if variant == "zmq-ipc":
        bind = f"ipc:///tmp/tandem-kv-bench-{os.getpid()}.sock"
    ctx = mp.get_context("spawn")
    r_conn, r_child = ctx.Pipe()
    s_conn, s_child = ctx.Pipe()
    n = iters + warmup
    rx = ctx.Process(target=receiver_main, args=(connector, bind, n_blocks, 2 * n, fragmented, r_child))
    rx.start()
    address, dest = r_conn.recv()
    tx = ctx.Process(target=sender_main, args=(connector, n_blocks, n, warmup, fragmented, address, dest, s_child))
    tx.start()
    latencies, streamed, memcpy, woken = s_conn.recv()
    r_conn.recv()
    r_conn.send("bye")
    tx.join(30)
    rx.join(30)
    return statistics.median(latencies), streamed, statistics.median(memcpy), statistics.median(woken)


def memcpy_times(nbytes: int, iters: int) -> list[float]:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fragmented", action="store_true", help="scattered (not consecutive) block ids on both sides")
    p.add_argument("--connectors", default=",".join(VARIANTS))
    args = p.parse_args()
    torch.set_num_threads(1)
    n_blocks = (args.tokens + LAYOUT.block_size - 1) // LAYOUT.block_size
    nbytes = n_blocks * LAYOUT.block_nbytes * LAYOUT.num_layers
    base = statistics.median(memcpy_times(nbytes, max(args.iters, 20)))
    base_gbs = nbytes / base / 1e9
    print(f"KV of {args.tokens} tokens: {n_blocks} blocks x {LAYOUT.num_layers} layers = {nbytes / 2**20:.1f} MiB"
          f"{' (fragmented block ids)' if args.fragmented else ''}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (other work on the box slows every row)")
    print(f"{'path':<11} {'one-at-a-time':>24} {'streamed':>24}")
    print(f"{'memcpy':<11} {base * 1e3:>7.2f} ms {base_gbs:>6.2f} GB/s  100% "
          f"{base * 1e3:>7.2f} ms {base_gbs:>6.2f} GB/s  100%")
    def row(name: str, times: tuple[float, float]) -> None:
        cols = [f"{t * 1e3:>7.2f} ms {nbytes / t / 1e9:>6.2f} GB/s {base / t:>4.0%}" for t in times]
        print(f"{name:<11} {cols[0]} {cols[1]}")

    tcp = raw_tcp_times(nbytes, args.iters, args.warmup)
    row("raw-tcp", tcp)
    for variant in args.connectors.split(","):
        *times, local, woken = run_connector(variant, n_blocks, args.iters, args.warmup, args.fragmented)
        row(variant, tuple(times))
        print(f"{'':<11} of the memcpy timed in the sender between its transfers ({local * 1e3:.2f} ms): "
              f"{local / times[0]:.0%} one-at-a-time, {local / times[1]:.0%} streamed")
        print(f"{'':<11} one at a time until a thread blocked in finish() runs: {woken * 1e3:.2f} ms "
              f"({base / woken:.0%} of memcpy, {local / woken:.0%} of the sender's)")
        if variant.endswith("-tcp") or variant == "torch_dist":
            print(f"{'':<11} of raw tcp: {tcp[0] / times[0]:.0%} one-at-a-time, {tcp[1] / times[1]:.0%} streamed")


if __name__ == "__main__":
    main()
