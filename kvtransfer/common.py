"""Helpers shared by both halves of every connector: inbox item types, the receiver's records of
expected requests and fences, cache checks, wake pipes, endpoint resolution and rate-limited drop logging."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.base import CacheLayout
from kvtransfer.wire import KVHeader
from tandem.protocol.codec import MAX_ID_LEN, only_ints


@dataclass(slots=True)
class Arrival:
    """A validated `kv` message whose payload is readable (or, for shm, already in place)."""

    peer: bytes
    header: KVHeader
    data: list[torch.Tensor] | None  # packed runs [k, 2, bs, H, D] in dest order; None: the sender wrote D's memory
    scale: list[torch.Tensor] | None  # the same runs' scales (int8/fp8)
    t_ns: int
    error: str | None = None  # e.g. checksum mismatch: the request fails


@dataclass(slots=True)
class Control:
    """done / cancel / cancel_ack from a handshaken peer."""

    peer: bytes
    msg: dict[str, Any]
    t_ns: int


@dataclass(slots=True)
class PeerFailed:
    """The data channel to a peer broke (torch_dist): its requests in flight fail."""

    peer: bytes
    reason: str


def check_request_id(request_id: Any) -> None:
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID_LEN:
        raise ValueError(f"request_id must be a non-empty str of at most {MAX_ID_LEN} chars, got {request_id!r}")


def check_block_ids(ids: Any, num_blocks: int | None, what: str) -> list[int]:
    # exact int types (bools rejected); min/max keep this cheap on long lists
    if not isinstance(ids, (list, tuple)) or not only_ints(ids):
        raise ValueError(f"{what} must be a list of ints, got {ids!r:.80}")
    hi = num_blocks if num_blocks is not None else 1 << 62
    if ids and (min(ids) < 0 or max(ids) >= hi):
        raise ValueError(f"{what} out of range [0, {hi}): {[i for i in ids if not 0 <= i < hi][:5]}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} contains duplicates")
    return ids if isinstance(ids, list) else list(ids)


class TransferIds:
    """send_layer's block-id check, memoised: a prompt's layers go out with the same ids, so the walk
    over a few hundred ids runs once, not per layer. The checked copies are what it returns, so an
    equal list of look-alikes (1.0, True) never reaches a copy."""

    def __init__(self) -> None:
        self.last: tuple[int, list[int], list[int]] | None = None

    def check(self, src_ids: Any, dest_ids: Any, num_blocks: int) -> tuple[list[int], list[int]]:
        last = self.last
        if last is not None and last[0] == num_blocks and last[1] == src_ids and last[2] == dest_ids:
            return last[1], last[2]
        src = list(check_block_ids(src_ids, num_blocks, "src_block_ids"))
        dest = list(check_block_ids(dest_ids, None, "dest_block_ids"))
        if len(src) != len(dest) or not src:
            raise ValueError(f"src_block_ids and dest_block_ids must be non-empty and equally long "
                             f"({len(src)} vs {len(dest)})")
        self.last = (num_blocks, src, dest)
        return src, dest


def check_cache(layout: CacheLayout, kv_cache: Any, kv_scale: Any, what: str) -> None:
    """One layer's cache (and scale) against the layout; any number of blocks."""
    if not isinstance(kv_cache, torch.Tensor) or tuple(kv_cache.shape[1:]) != layout.block_shape:
        shape = getattr(kv_cache, "shape", None)
        dims = ", ".join(map(str, layout.block_shape))
        raise ValueError(f"{what}: expected a tensor [num_blocks, {dims}], got {shape}")
    if kv_cache.dtype != layout.torch_kv_dtype or not kv_cache.is_contiguous():
        raise ValueError(f"{what}: expected a contiguous {layout.kv_cache_dtype} tensor, got {kv_cache.dtype}")
    if layout.is_quantized:
        want = (kv_cache.shape[0], *layout.scale_block_shape)
        if not isinstance(kv_scale, torch.Tensor) or tuple(kv_scale.shape) != want or kv_scale.dtype != torch.float32:
            raise ValueError(f"{what}: a {layout.kv_cache_dtype} cache needs a float32 kv_scale of shape {list(want)}")
    elif kv_scale is not None:
        raise ValueError(f"{what}: kv_scale must be None for a {layout.kv_cache_dtype} cache")


def check_caches(layout: CacheLayout, kv_caches: Any, kv_scales: Any) -> int:
    """All layers of D's cache against the layout; returns num_blocks."""
    if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != layout.num_layers:
        raise ValueError(f"kv_caches must be a list of {layout.num_layers} per-layer tensors")
    if kv_scales is not None and (not isinstance(kv_scales, (list, tuple)) or len(kv_scales) != layout.num_layers):
        raise ValueError(f"kv_scales must be None or a list of {layout.num_layers} per-layer tensors")
    num_blocks = kv_caches[0].shape[0] if isinstance(kv_caches[0], torch.Tensor) else -1
    for layer, cache in enumerate(kv_caches):
        check_cache(layout, cache, None if kv_scales is None else kv_scales[layer], f"kv_caches[{layer}]")
        if cache.shape[0] != num_blocks or cache.device != kv_caches[0].device:
            raise ValueError("all layers must have the same number of blocks and live on the same device")
    return num_blocks


class WakePipe:
    """Lets any thread wake an I/O thread blocked in zmq.Poller (which can poll a raw fd). Only the
    first wake after a drain writes: a burst of commands costs one syscall and one wake-up."""

    def __init__(self) -> None:
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self._pending = False

    def wake(self) -> None:
        # Callers enqueue first, then wake; the woken thread drains, then reads the queue. A wake that
        # finds the flag still set (drain has emptied the pipe but not yet cleared it) writes nothing,
        # and its item is seen by that read.
        if self._pending:
            return
        self._pending = True
        try:
            os.write(self.wfd, b"x")
        except (BlockingIOError, OSError):  # pipe full: a wake-up is already pending; closed: shutting down
            pass

    def drain(self) -> None:
        # Empty the pipe first, then clear the flag. The other order lost wake-ups: a wake between the
        # two wrote a byte this read swallowed, leaving the flag set over an empty pipe, so every later
        # wake wrote nothing and its thread slept out its poll timeout (1 s: a KV transfer's ack late).
        try:
            while os.read(self.rfd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._pending = False

    def close(self) -> None:
        for fd in (self.rfd, self.wfd):
            try:
                os.close(fd)
            except OSError:
                pass


def resolve_endpoint(last_endpoint: str) -> str:
    """A bound endpoint -> one a peer can connect to (a wildcard host becomes this host's address)."""
    if last_endpoint.startswith("tcp://"):
        host, _, port = last_endpoint[len("tcp://"):].rpartition(":")
        if host in ("0.0.0.0", "*", "[::]", "::"):
            return f"tcp://{socket.gethostbyname(socket.gethostname())}:{port}"
    return last_endpoint


def endpoint_host(address: str) -> str:
    """Host part of a tcp:// endpoint; loopback for ipc:// (same host by definition)."""
    if address.startswith("tcp://"):
        return address[len("tcp://"):].rpartition(":")[0].strip("[]")
    return "127.0.0.1"


def local_ip_towards(host: str) -> str:
    """The local address the kernel would use to reach `host` (no packet is sent)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class DropLog:
    """Logs dropped messages without letting a flood of garbage flood the log: the first few of each
    reason, then every 1000th, with the running count."""

    def __init__(self, logger: Any, first: int = 5, every: int = 1000) -> None:
        self._log, self._first, self._every = logger, first, every
        self.counts: dict[str, int] = {}

    def __call__(self, reason: str, **details: Any) -> None:
        n = self.counts.get(reason, 0) + 1
        self.counts[reason] = n
        if n <= self._first or n % self._every == 0:
            self._log.warning("kv_message_dropped", reason=reason, count=n, **details)


@dataclass(slots=True)
class PendingTransfer:
    """The receiver's record of one expected request (BaseReceiver.expect)."""

    dest_ids: list[int]
    dest_set: frozenset[int]
    timeout_ns: int
    last_ns: int
    covered: list[set[int]]
    peer: bytes | None = None
    messages: int = 0
    nbytes: int = 0
    done: tuple[int, int] | None = None
    result: dict = field(default_factory=dict)  # the sender's completion map (a prefill worker: first token)

    def problem(self) -> str:
        """Once the `done` and every message it counts arrived: "" if the transfer is whole, else why not."""
        assert self.done is not None
        if self.messages != self.done[0] or self.nbytes != self.done[1]:
            return (f"sender sent {self.done[0]} messages / {self.done[1]} bytes, "
                    f"received {self.messages} / {self.nbytes}")
        missing = [layer for layer, got in enumerate(self.covered) if len(got) != len(self.dest_ids)]
        return f"incomplete: layers {missing[:8]} lack some of the {len(self.dest_ids)} expected blocks" \
            if missing else ""


@dataclass(slots=True)
class Fence:
    """A cancelled shm request waiting for its senders' cancel_ack before it is reported."""

    reason: str
    waiting: set[bytes]
    deadline_ns: int
