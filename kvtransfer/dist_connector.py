"""The `torch_dist` connector: KV payloads over torch.distributed send/recv (gloo on CPU, NCCL on CUDA).

Every sender-receiver pair gets its own two-rank process group (sender rank 0, receiver rank 1),
built at handshake time over the receiver's TCPStore under a per-pair prefix, so any number of P
and D workers pair up without a global world. Control stays on ZMQ: the `kv` header (with a
per-pair tag) goes first, then the layer's blocks and scales as one flat byte buffer under that tag.
On D a thread per pair receives into a staging buffer (recv blocks, so it cannot live in poll());
poll() scatters it into the cache, so late data for a cancelled request never touches D's blocks.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import torch.distributed as dist
import zmq

from kvtransfer import wire
from kvtransfer.base import CacheLayout, KVConnector
from kvtransfer.blocks import gather
from kvtransfer.common import Arrival, PeerFailed, endpoint_host, local_ip_towards
from kvtransfer.receiver import BaseReceiver, Peer
from kvtransfer.sender import BaseSender, Link, Outgoing

log = structlog.get_logger(__name__)
STORE_PREFIX = "tandem-kv"
SENDER_READY = "sender_ready"
PAIR_SETUP_S = 10.0  # how long a handshaken sender has to start building the pair's group


def make_group(store: dist.Store, rank: int, backend: str, host: str, timeout_s: float) -> dist.ProcessGroup:
    """A two-rank process group over `store` (already prefixed for the pair)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def gpu_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (None off CUDA): NCCL cannot pair two processes on one GPU, so the sender
    refuses a receiver on its own GPU at handshake instead of failing every transfer later."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def _split(buf: torch.Tensor, layout: CacheLayout, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The flat payload buffer as (blocks [n, 2, bs, H, D], scales [n, 2, bs, H] or None)."""
    data_nbytes = n * layout.block_nbytes
    data = buf[:data_nbytes].view(layout.torch_kv_dtype).view(n, *layout.block_shape)
    if not layout.is_quantized:
        return data, None
    return data, buf[data_nbytes:].view(torch.float32).view(n, *layout.scale_block_shape)


@dataclass(slots=True)
class _Pair:
    """D's side of one sender: its jobs (headers whose payload is due) and receiving thread."""

    name: str
    jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None


class DistReceiver(BaseReceiver):
    connector_name = "torch_dist"

    def _setup(self) -> None:
        self._host = endpoint_host(self.address)
        self._backend = "nccl" if self.kv_caches[0].device.type == "cuda" else "gloo"
        self._store = dist.TCPStore(self._host, 0, None, True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self._timeout_s))

    def _accept_peer(self, peer: bytes, hello: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        pair = _Pair(uuid.uuid4().hex)
        pair.thread = threading.Thread(target=self._pair_loop, args=(peer, pair), daemon=True,
                                       name=f"kv-recv-pair-{pair.name[:8]}")
        pair.thread.start()
        extra = {"store_host": self._host, "store_port": self._store.port, "pair": pair.name,
                 "backend": self._backend, "timeout_s": self._timeout_s, "gpu": gpu_uuid(self.kv_caches[0].device)}
        return extra, pair

    def _drop_peer(self, info: Peer) -> None:
        info.state.jobs.put(None)

    def close(self) -> None:
        with self._peers_lock:
            threads = {id(i): i.state.thread for i in self.peers.values()}.values()
        super().close()
        # Let each pair thread destroy its process group now: a daemon thread still inside gloo's
        # destructor when the interpreter exits aborts the process.
        for thread in threads:
            if thread is not None:
                thread.join(timeout=2)

    def _on_kv(self, peer: bytes, info: Peer, header: wire.KVHeader, frames: list[zmq.Frame], t_ns: int) -> None:
        if frames or header.tag is None:
            raise wire.ProtocolError("kv: torch_dist headers carry a tag and no payload frames")
        info.state.jobs.put((header, t_ns))

    def _pair_loop(self, peer: bytes, pair: _Pair) -> None:
        device = self.kv_caches[0].device
        store = dist.PrefixStore(f"{STORE_PREFIX}/{pair.name}", self._store)
        # Build the group only once the sender says it is building its half: group construction
        # blocks (and constructions in one process queue behind each other), so a peer that
        # handshakes and vanishes must not hold up the next sender's pairing.
        deadline = time.monotonic() + PAIR_SETUP_S
        while not store.check([SENDER_READY]):
            if self._stop.is_set() or time.monotonic() > deadline:
                self._fail_peer(peer, f"sender did not build its process group within {PAIR_SETUP_S}s")
                return
            time.sleep(0.01)
        try:
            group = make_group(store, 1, self._backend, self._host, self._timeout_s)
        except Exception as exc:  # the sender died meanwhile, or the backend is unusable
            self._fail_peer(peer, f"process group setup failed: {exc}")
            return
        while not self._stop.is_set():
            job = pair.jobs.get()
            if job is None:
                return
            header, t_ns = job
            buf = torch.empty(header.nbytes, dtype=torch.uint8, device=device)
            try:
                group.recv([buf], 0, header.tag).wait()
            except Exception as exc:  # peer died or stalled past the timeout: the pair is unusable
                self._fail_peer(peer, f"recv failed: {str(exc)[:200]}")
                return
            data, scale = _split(buf, self.layout, len(header.dest_block_ids))
            error = None
            if header.checksum is not None and wire.payload_crc(
                    data.cpu(), None if scale is None else scale.cpu()) != header.checksum:
                error = "checksum mismatch"
            self._inbox.put(Arrival(peer, header, [data], None if scale is None else [scale], t_ns, error))

    def _fail_peer(self, peer: bytes, reason: str) -> None:
        log.warning("kv_pair_failed", reason=reason)
        with self._peers_lock:
            self.remove_peer(peer)  # it must handshake again
        self._notify(PeerFailed(peer, reason))


@dataclass(slots=True)
class _Group:
    """P's side of one receiver."""

    group: Any
    store: Any
    next_tag: int = 0
    broken: bool = False


class DistSender(BaseSender):
    connector_name = "torch_dist"
    direct_send = False  # group.send(...).wait() blocks until D receives: it runs on the I/O thread

    def _on_connected(self, address: str, extra: dict[str, Any]) -> _Group:
        host, port, pair = extra.get("store_host"), extra.get("store_port"), extra.get("pair")
        backend, timeout_s = extra.get("backend"), extra.get("timeout_s")
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(pair, str)
                and backend in ("gloo", "nccl") and isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"receiver sent an unusable torch_dist description: {str(extra)[:200]}")
        if (backend == "nccl") != (self.device.type == "cuda"):
            raise ValueError(f"receiver uses {backend} but this sender's device is {self.device}: "
                             "both sides must be on CUDA (nccl) or both on CPU (gloo)")
        mine = gpu_uuid(self.device)
        if mine is not None and extra.get("gpu") == mine:
            raise ValueError(f"the receiver's KV cache is on this sender's own GPU ({mine}): NCCL cannot connect two "
                             "processes on one GPU; use --kv-connector zmq when prefill and decode share a GPU")
        store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
        prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{pair}", store)
        prefixed.set(SENDER_READY, b"1")
        group = make_group(prefixed, 0, backend, local_ip_towards(host), timeout_s)
        return _Group(group, store)

    def _pack(self, state: _Group, request_id: str, layer: int, kv_cache: torch.Tensor,
              kv_scale: torch.Tensor | None, src: list[int], dest: list[int], borrow: bool) -> Outgoing:
        n = len(src)
        buf = torch.empty(n * (self.layout.block_nbytes + self.layout.scale_block_nbytes), dtype=torch.uint8,
                          device=kv_cache.device)
        data, scale = _split(buf, self.layout, n)
        gather(self.ops, kv_cache, src, out=data)
        if scale is not None and kv_scale is not None:
            gather(self.ops, kv_scale, src, out=scale)
        crc = wire.payload_crc(data.cpu(), None if scale is None else scale.cpu()) if self.checksum else None
        tag, state.next_tag = state.next_tag, (state.next_tag + 1) % wire.MAX_TAG  # under the sender lock
        header = wire.kv_header(self.layout, request_id, layer, dest, checksum=crc, tag=tag)
        return Outgoing(request_id, header, nbytes=buf.numel(), payload=buf, tag=tag)

    def _transmit(self, link: Link, item: Outgoing) -> bool:
        if item.payload is None:
            return super()._transmit(link, item)
        if link.state.broken:
            return True  # dropped: the receiver will refuse the request's done
        if not super()._transmit(link, item):  # the header first: D posts the matching recv on it
            return False
        try:
            link.state.group.send([item.payload], 1, item.tag).wait()
        except Exception as exc:
            log.warning("kv_pair_send_failed", address=link.address, error=str(exc)[:200])
            link.state.broken = True
        return True


class DistConnector(KVConnector):
    """Pairwise torch.distributed groups; gloo for CPU caches, NCCL when both caches are on CUDA."""

    name = "torch_dist"

    def make_receiver(self, layout: CacheLayout, kv_caches: list[torch.Tensor],
                      kv_scales: list[torch.Tensor] | None, bind: str | None = None) -> DistReceiver:
        return DistReceiver(layout, kv_caches, kv_scales, bind, timeout_s=self.timeout_s)

    def make_sender(self, layout: CacheLayout, device: torch.device | str = "cpu") -> DistSender:
        return DistSender(layout, device, checksum=self.checksum)
