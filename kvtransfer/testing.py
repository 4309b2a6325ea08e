"""Out-of-process KV transfer workers for tests: `python -m kvtransfer.testing` runs one.

A worker holds any number of receivers and senders by name and obeys JSON-lines commands on stdin,
answering one JSON line each on (the original) stdout; logs go to stderr. JSON, not pickle, so the
harness itself never unpickles anything. Caches are made from a seed (`make_cache`), so the test
process can recompute the exact bytes a sender holds and compare digests with what D received.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from queue import Empty, Queue
from typing import Any

import structlog
import torch

from kvtransfer import CONNECTORS, CacheLayout, HandshakeError, LayerReceived, TransferDone, TransferEvent
from kvtransfer.wire import as_bytes


def make_cache(layout: CacheLayout, num_blocks: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, *layout.block_shape)
    if layout.kv_cache_dtype == "int8":
        caches = [torch.randint(-128, 128, shape, generator=g, dtype=torch.int8) for _ in range(layout.num_layers)]
    else:
        caches = [torch.randn(shape, generator=g).to(layout.torch_kv_dtype) for _ in range(layout.num_layers)]
    scales = None
    if layout.is_quantized:
        scales = [torch.rand((num_blocks, *layout.scale_block_shape), generator=g) for _ in range(layout.num_layers)]
    return caches, scales


def digest(caches: list[torch.Tensor], scales: list[torch.Tensor] | None, ids: list[int]) -> str:
    """sha256 over every layer's blocks `ids` (and their scales), in order."""
    h = hashlib.sha256()
    idx = torch.tensor(ids, dtype=torch.long)
    for layer, cache in enumerate(caches):
        h.update(as_bytes(cache[idx].contiguous()))
        if scales is not None:
            h.update(as_bytes(scales[layer][idx].contiguous()))
    return h.hexdigest()


def event_dict(ev: TransferEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(ev).__name__, "rid": ev.request_id}
    if isinstance(ev, LayerReceived):
        out["layer"] = ev.layer
    elif isinstance(ev, TransferDone):
        out["bytes"] = ev.bytes
    else:
        out["reason"] = ev.reason
    return out


class _Worker:
    """Senders are driven directly; each receiver gets a pump thread that polls it like D's step loop
    (the lock serialises the pump with expect/cancel/fill, as D's single engine thread would)."""

    def __init__(self) -> None:
        self.objs: dict[str, Any] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.events: dict[str, list[dict]] = {}
        self.connectors: dict[str, Any] = {}

    def _pump(self, name: str) -> None:
        while name in self.objs:
            with self.locks[name]:
                if name not in self.objs:
                    return
                self.events[name].extend(event_dict(e) for e in self.objs[name][0].poll(10))
            time.sleep(0.001)

    def _take(self, name: str) -> list[dict]:
        with self.locks[name]:
            out, self.events[name] = self.events[name], []
        return out

    def open_receiver(self, name: str, connector: str, layout: dict, num_blocks: int, timeout_s: float = 30.0,
                      fence_timeout_s: float | None = None, bind: str | None = None) -> dict:
        c = CONNECTORS[connector](timeout_s=timeout_s)
        lay = CacheLayout(**layout)
        caches, scales = c.allocate_kv_caches(lay, num_blocks)
        rx = c.make_receiver(lay, caches, scales, bind)
        if fence_timeout_s is not None:
            rx.FENCE_TIMEOUT_S = fence_timeout_s
        self.locks[name], self.events[name] = threading.Lock(), []
        self.objs[name] = (rx, caches, scales)
        self.connectors[name] = c
        threading.Thread(target=self._pump, args=(name,), daemon=True).start()
        return {"address": rx.address}

    def open_sender(self, name: str, connector: str, layout: dict, num_blocks: int, seed: int,
                    checksum: bool = False) -> dict:
        lay = CacheLayout(**layout)
        self.objs[name] = (CONNECTORS[connector](checksum=checksum).make_sender(lay, "cpu"),
                           *make_cache(lay, num_blocks, seed))
        return {}

    def connect(self, name: str, address: str, timeout_s: float = 10.0) -> dict:
        try:
            self.objs[name][0].connect(address, timeout_s=timeout_s)
        except HandshakeError as exc:
            return {"handshake_error": str(exc)}
        return {}

    def send(self, name: str, address: str, rid: str, src: list[int], dest: list[int],
             layers: list[int] | None = None, delay_s: float = 0.0, background: bool = False,
             borrow: bool = False) -> dict:
        tx, caches, scales = self.objs[name]

        def run() -> None:
            for layer in layers if layers is not None else range(len(caches)):
                tx.send_layer(address, rid, layer, caches[layer], None if scales is None else scales[layer], src, dest,
                              borrow=borrow)
                time.sleep(delay_s)
        if background:
            threading.Thread(target=run, daemon=True).start()
        else:
            run()
        return {}

    def finish(self, name: str, rid: str, timeout_s: float = 30.0, address: str | None = None) -> dict:
        return {"ok": self.objs[name][0].finish(rid, timeout_s, address)}

    def cancel(self, name: str, rid: str) -> dict:
        self.objs[name][0].cancel(rid)
        return {}

    def stats(self, name: str) -> dict:
        s = self.objs[name][0].stats
        return {"bytes_sent": s.bytes_sent, "transfers": s.transfers, "failures": s.failures}

    def expect(self, name: str, rid: str, dest: list[int], timeout_s: float | None = None) -> dict:
        with self.locks[name]:
            self.objs[name][0].expect(rid, dest, timeout_s)
        return {}

    def poll(self, name: str, ms: int = 0) -> dict:
        time.sleep(ms / 1000)
        return {"events": self._take(name)}

    def wait(self, name: str, rids: list[str], timeout_s: float) -> dict:
        """Events until every rid in `rids` ended (TransferDone / TransferFailed) or timeout_s passed."""
        events: list[dict] = []
        left, deadline = set(rids), time.monotonic() + timeout_s
        while left and time.monotonic() < deadline:
            for e in self._take(name):
                events.append(e)
                if e["type"] != "LayerReceived":
                    left.discard(e["rid"])
            time.sleep(0.005)
        return {"events": events}

    def digest(self, name: str, ids: list[int]) -> dict:
        _, caches, scales = self.objs[name]
        with self.locks.get(name, threading.Lock()):
            return {"digest": digest(caches, scales, ids)}

    def fill(self, name: str, ids: list[int], value: int) -> dict:
        _, caches, scales = self.objs[name]
        with self.locks[name]:
            for layer, cache in enumerate(caches):
                cache[ids] = torch.full_like(cache[ids], value)
                if scales is not None:
                    scales[layer][ids] = float(value)
        return {}

    def cancel_receiving(self, name: str, rid: str) -> dict:
        with self.locks[name]:
            self.objs[name][0].cancel(rid)
        return {}

    def numpy_probe(self) -> dict:
        """Whether numpy is blocked here (tests run workers with `sys.modules['numpy'] = None`)."""
        return {"blocked": "numpy" in sys.modules and sys.modules["numpy"] is None}

    def close(self, name: str) -> dict:
        with self.locks.get(name, threading.Lock()):
            obj, caches, _ = self.objs.pop(name)
        obj.close()
        if name in self.connectors:
            self.connectors.pop(name).free_kv_caches(caches)
        return {}


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed (logs included) goes to stderr, never into the protocol
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    torch.set_num_threads(1)
    worker = _Worker()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = getattr(worker, cmd.pop("op"))(**cmd)
        except Exception as exc:  # reported to the test, which fails with it
            reply = {"exception": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(reply) + "\n")
    for name in list(worker.objs):
        worker.close(name)


class Proc:
    """Test-side handle on a worker process."""

    def __init__(self, cwd: str, without_numpy: bool = False) -> None:
        """`without_numpy`: the worker runs as if numpy were not installed (it is not a dependency)."""
        env = {**os.environ, "PYTHONPATH": cwd + os.pathsep + os.environ.get("PYTHONPATH", "")}
        argv = [sys.executable, "-m", "kvtransfer.testing"]
        if without_numpy:  # a None entry makes every `import numpy` fail, torch's own included
            argv[1:] = ["-c", "import runpy, sys; sys.modules['numpy'] = None; "
                              "runpy.run_module('kvtransfer.testing', run_name='__main__')"]
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr)
        self._lines: Queue[str] = Queue()
        threading.Thread(target=lambda: [self._lines.put(x) for x in self.proc.stdout], daemon=True).start()

    def __call__(self, op: str, timeout: float = 60.0, **kw: Any) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            reply = json.loads(self._lines.get(timeout=timeout))
        except Empty:
            raise TimeoutError(f"worker did not answer {op} within {timeout}s") from None
        if "exception" in reply:
            raise RuntimeError(f"worker {op} failed: {reply['exception']}")
        return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


if __name__ == "__main__":
    main()
