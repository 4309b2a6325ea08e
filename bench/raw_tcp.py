"""The raw TCP reference for bench/kv_transfer.py: the same bytes over a plain loopback socket between
two processes (sendall of the bytes, recv_into a preallocated buffer, a 1-byte ack per
transfer) — what any TCP transport could get on this machine, so zmq-tcp is judged against it, not
only against memcpy. Same two timings: one at a time (wait for each ack) and streamed (acks at the end).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time


def _receiver(port_conn, nbytes: int, n: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    sock, _ = srv.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(nbytes))
    for _ in range(n):
        got = 0
        while got < nbytes:
            got += sock.recv_into(buf[got:], nbytes - got)
        sock.sendall(b"k")
    sock.close()
    srv.close()


def _sender(port: int, nbytes: int, iters: int, warmup: int, out_conn) -> None:
    data = memoryview(os.urandom(nbytes))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    latencies = []
    for _ in range(iters + warmup):
        t0 = time.perf_counter()
        sock.sendall(data)
        sock.recv(1)
        latencies.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(iters):
        sock.sendall(data)
    for _ in range(iters):
        sock.recv(1)  # 1-byte acks, one per transfer (they may arrive together: count them)
    streamed = (time.perf_counter() - t0) / iters
    out_conn.send((statistics.median(latencies[warmup:]), streamed))
    sock.close()


def raw_tcp_times(nbytes: int, iters: int, warmup: int) -> tuple[float, float]:
    """(median one-at-a-time seconds, streamed seconds per transfer) of nbytes over loopback TCP."""
    ctx = mp.get_context("spawn")
    port_parent, port_child = ctx.Pipe()
    out_parent, out_child = ctx.Pipe()
    rx = ctx.Process(target=_receiver, args=(port_child, nbytes, 2 * iters + warmup))
    rx.start()
    tx = ctx.Process(target=_sender, args=(port_parent.recv(), nbytes, iters, warmup, out_child))
    tx.start()
    result = out_parent.recv()
    tx.join(30)
    rx.join(30)
    return result
