"""KV connectors between real processes on loopback: exact bytes, per-layer events, refused handshakes,
garbage that must not hurt the receiver, cancellation, and a sender killed mid-transfer.

Each connector gets one receiver process and one sender process (kvtransfer.testing workers, driven
by JSON lines); the fuzzing comes from this process's own ZMQ sockets.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import zmq

from kvtransfer import CacheLayout, wire
from kvtransfer.testing import Proc, digest, make_cache

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

ROOT = str(Path(__file__).resolve().parents[1])
FP32 = CacheLayout("tiny", "float32", "float32", block_size=4, num_layers=4, num_kv_heads=2, head_dim=8)
INT8 = replace(FP32, kv_cache_dtype="int8")
LAYOUTS = {"fp32": FP32, "int8": INT8}
P_BLOCKS, D_BLOCKS, SEED = 32, 64, 1234
CONNECTOR_NAMES = ["zmq", "shm", "torch_dist"]
V = wire.PROTOCOL_VERSION


class Rig:
    def __init__(self, connector: str) -> None:
        self.connector = connector
        self.d, self.p = Proc(ROOT), Proc(ROOT)
        self.addr: dict[str, str] = {}
        self._n = 0
        for key, layout in LAYOUTS.items():
            self.addr[key] = self.d("open_receiver", name=key, connector=connector, layout=layout.to_dict(),
                                    num_blocks=D_BLOCKS, fence_timeout_s=1.0)["address"]
            self.p("open_sender", name=key, connector=connector, layout=layout.to_dict(), num_blocks=P_BLOCKS,
                   seed=SEED, checksum=key == "int8")
            assert self.p("connect", name=key, address=self.addr[key]) == {}

    def rid(self) -> str:
        self._n += 1
        return f"req-{self._n}"

    def transfer(self, key: str, src: list[int], dest: list[int], borrow: bool = False) -> tuple[str, list[dict], bool]:
        rid = self.rid()
        self.d("expect", name=key, rid=rid, dest=dest)
        self.p("send", name=key, address=self.addr[key], rid=rid, src=src, dest=dest, borrow=borrow)
        ok = self.p("finish", name=key, rid=rid, timeout_s=20)["ok"]
        return rid, self.d("wait", name=key, rids=[rid], timeout_s=10)["events"], ok


@pytest.fixture(scope="module", params=CONNECTOR_NAMES)
def rig(request: pytest.FixtureRequest) -> Rig:
    r = Rig(request.param)
    yield r
    r.p.close()
    r.d.close()


def expected_digest(key: str, src: list[int]) -> str:
    return digest(*make_cache(LAYOUTS[key], P_BLOCKS, SEED), src)


@pytest.mark.parametrize("key", ["fp32", "int8"])
def test_transfer_is_exact_with_ordered_layer_events(rig: Rig, key: str) -> None:
    scattered = random.Random(3)  # more runs than blocks.MAX_SLICE_RUNS: the kernels' gather/scatter path
    cases = [([0, 1, 2, 3], [10, 11, 12, 13]), ([31, 5, 17, 2, 9], [40, 3, 63, 22, 7]), ([6], [0]),
             (scattered.sample(range(P_BLOCKS), 12), scattered.sample(range(D_BLOCKS), 12))]
    for (src, dest), borrow in [(c, b) for c in cases for b in (False, True)]:  # borrow: zmq frames per run
        rid, events, ok = rig.transfer(key, src, dest, borrow)
        assert ok
        assert [e["layer"] for e in events if e["type"] == "LayerReceived"] == list(range(FP32.num_layers))
        layout = LAYOUTS[key]
        nbytes = len(src) * layout.num_layers * (layout.block_nbytes + layout.scale_block_nbytes)
        assert events[-1] == {"type": "TransferDone", "rid": rid, "bytes": nbytes}
        assert rig.d("digest", name=key, ids=dest)["digest"] == expected_digest(key, src)
    # Chunked prefill: every layer arrives once per chunk; done only after the last chunk.
    rid = rig.rid()
    rig.d("expect", name=key, rid=rid, dest=[50, 51, 52])
    rig.p("send", name=key, address=rig.addr[key], rid=rid, src=[7, 8], dest=[50, 51])
    rig.p("send", name=key, address=rig.addr[key], rid=rid, src=[9], dest=[52])
    assert rig.p("finish", name=key, rid=rid, timeout_s=20)["ok"]
    events = rig.d("wait", name=key, rids=[rid], timeout_s=10)["events"]
    assert [e["layer"] for e in events if e["type"] == "LayerReceived"] == [0, 1, 2, 3] * 2
    assert events[-1]["type"] == "TransferDone"
    assert rig.d("digest", name=key, ids=[50, 51, 52])["digest"] == expected_digest(key, [7, 8, 9])


def test_request_with_nothing_to_send_completes(rig: Rig) -> None:
    rid = rig.rid()  # D had every block cached: P only declares the request finished
    rig.d("expect", name="fp32", rid=rid, dest=[])
    assert rig.p("finish", name="fp32", rid=rid, timeout_s=20, address=rig.addr["fp32"])["ok"]
    assert rig.d("wait", name="fp32", rids=[rid], timeout_s=10)["events"] == [
        {"type": "TransferDone", "rid": rid, "bytes": 0}]


def test_incomplete_transfer_is_refused(rig: Rig) -> None:
    rid = rig.rid()
    rig.d("expect", name="fp32", rid=rid, dest=[20, 21])
    rig.p("send", name="fp32", address=rig.addr["fp32"], rid=rid, src=[1, 2], dest=[20, 21], layers=[0, 1, 2])
    assert rig.p("finish", name="fp32", rid=rid, timeout_s=20)["ok"] is False
    events = rig.d("wait", name="fp32", rids=[rid], timeout_s=10)["events"]
    assert events[-1]["type"] == "TransferFailed" and "layers [3]" in events[-1]["reason"]


@pytest.mark.parametrize("change, fields", [
    ({"block_size": 8}, ["block_size"]),
    ({"num_kv_heads": 4, "kv_cache_dtype": "bfloat16"}, ["kv_cache_dtype", "num_kv_heads"]),
])
def test_handshake_with_a_different_layout_is_refused(rig: Rig, change: dict, fields: list[str]) -> None:
    name = "bad-" + "-".join(fields)
    rig.p("open_sender", name=name, connector=rig.connector, layout=replace(FP32, **change).to_dict(),
          num_blocks=4, seed=0)
    err = rig.p("connect", name=name, address=rig.addr["fp32"])["handshake_error"]
    assert "layout mismatch" in err
    for f in fields:
        assert f"{f}: receiver={getattr(FP32, f)!r} sender={change[f]!r}" in err


def test_handshake_with_another_connector_is_refused(rig: Rig) -> None:
    other = "zmq" if rig.connector != "zmq" else "torch_dist"
    rig.p("open_sender", name="other", connector=other, layout=FP32.to_dict(), num_blocks=4, seed=0)
    err = rig.p("connect", name="other", address=rig.addr["fp32"])["handshake_error"]
    assert f"connector mismatch: sender speaks {other!r}" in err


def _garbage(rng: random.Random, layout: CacheLayout) -> list[bytes]:
    n = rng.randrange(1, 4)
    good = {"type": "kv", "v": V, "request_id": "nope", "layer": 0, "dest_block_ids": [1],
            "dtype": layout.kv_cache_dtype, "shape": [1, *layout.block_shape], "scale_shape": None,
            "checksum": None, "tag": 0}
    bad_values = [-1, 10**6, "x", None, True, [], [-1], ["a"], [2**63 - 1], [1, 1], 1.5, {"a": 1}, "float64"]
    kind = rng.randrange(9)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 200)) for _ in range(n)]
    if kind == 1:
        return [msgpack.packb(rng.choice([1, "hello", [1, 2], None, b"\x00", {"type": "kv"}, {1: 2}]))]
    if kind == 2:
        return [msgpack.packb({**good, "v": rng.choice([0, V + 1, str(V), None])})]
    if kind == 3:
        return [msgpack.packb({**good, "type": rng.choice(["xx", "hello_ok", "done_ack", "kv_error", 7])})]
    if kind == 4:  # one field broken, or missing, or an extra one
        msg = dict(good)
        field = rng.choice(list(msg)[2:])
        if rng.random() < 0.2:
            del msg[field]
        else:
            msg[field] = rng.choice(bad_values)
        return [msgpack.packb(msg)] + [rng.randbytes(layout.block_nbytes) for _ in range(n - 1)]
    if kind == 5:  # well formed but for an unknown request / with payloads of the wrong size
        return [msgpack.packb({**good, "request_id": f"unknown-{rng.random()}"}), rng.randbytes(layout.block_nbytes)]
    if kind == 6:
        return [msgpack.packb({"type": rng.choice(["done", "cancel", "cancel_ack"]), "v": V,
                               "request_id": rng.choice(["x", 5, None]), "messages": 1, "bytes": rng.choice([1, -1])})]
    if kind == 7:  # bad handshakes
        bad_layout = {**layout.to_dict(), rng.choice(["block_size", "head_dim"]): rng.choice([0, -4, "16", None])}
        return [msgpack.packb({"type": "hello", "v": V, "connector": "zmq", "sender_id": "fuzz",
                               "layout": rng.choice([bad_layout, {}, [1], "x"]), "data_id": None})]
    return [b""]


def test_garbage_does_not_hurt_the_receiver(rig: Rig) -> None:
    rng = random.Random(7)
    ctx = zmq.Context()
    sockets = [ctx.socket(zmq.DEALER) for _ in range(3)]
    try:
        for s in sockets:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(rig.addr["fp32"])
        # the third socket completes a handshake first, so its garbage reaches the post-handshake checks
        hello = wire.encode("hello", connector=rig.connector, sender_id="fuzz", layout=FP32.to_dict(), data_id=None)
        sockets[2].send(hello)
        assert sockets[2].poll(10_000) and wire.decode(sockets[2].recv())["type"] == "hello_ok"
        for i in range(3000):
            sockets[i % 3].send_multipart(_garbage(rng, FP32))
        for s in sockets:  # answers: errors, and refusals of done for requests nobody expects
            while s.poll(500):
                reply = wire.decode(s.recv())
                assert reply["type"] == "kv_error" or reply["type"] == "done_ack" and not reply["ok"]
        sockets[0].send(msgpack.packb({"type": "hello", "v": V, "connector": rig.connector,
                                       "sender_id": "fuzz", "layout": {"block_size": "big"}, "data_id": None}))
        assert sockets[0].poll(10_000)
        reply = wire.decode(sockets[0].recv())
        assert reply["type"] == "kv_error" and "bad layout in handshake" in reply["reason"]
        if rig.addr["fp32"].startswith("tcp://"):  # not even ZMTP
            host, port = rig.addr["fp32"][6:].rsplit(":", 1)
            for _ in range(20):
                with socket.create_connection((host, int(port))) as raw:
                    raw.sendall(os.urandom(rng.randrange(1, 4096)))
    finally:
        for s in sockets:
            s.close()
        ctx.term()
    rid, events, ok = rig.transfer("fp32", [3, 4], [30, 31])
    assert ok and events[-1]["type"] == "TransferDone"
    assert rig.d("digest", name="fp32", ids=[30, 31])["digest"] == expected_digest("fp32", [3, 4])


def test_cancel_drops_late_data(rig: Rig) -> None:
    rid = rig.rid()
    rig.d("expect", name="fp32", rid=rid, dest=[44, 45])
    rig.d("fill", name="fp32", ids=[44, 45], value=7)
    before = rig.d("digest", name="fp32", ids=[44, 45])["digest"]
    rig.d("cancel_receiving", name="fp32", rid=rid)
    events = rig.d("wait", name="fp32", rids=[rid], timeout_s=10)["events"]
    assert events == [{"type": "TransferFailed", "rid": rid, "reason": "cancelled"}]
    rig.p("send", name="fp32", address=rig.addr["fp32"], rid=rid, src=[1, 2], dest=[44, 45])
    assert rig.p("finish", name="fp32", rid=rid, timeout_s=10)["ok"] is False
    assert rig.d("poll", name="fp32", ms=300)["events"] == []
    assert rig.d("digest", name="fp32", ids=[44, 45])["digest"] == before
    # ... and a cancel from the sender's side ends the request on D.
    rid = rig.rid()
    rig.d("expect", name="fp32", rid=rid, dest=[46])
    rig.p("send", name="fp32", address=rig.addr["fp32"], rid=rid, src=[1], dest=[46], layers=[0])
    rig.p("cancel", name="fp32", rid=rid)
    events = rig.d("wait", name="fp32", rids=[rid], timeout_s=10)["events"]
    assert events[-1] == {"type": "TransferFailed", "rid": rid, "reason": "cancelled by sender"}


def test_killed_sender_never_yields_done(rig: Rig) -> None:
    victim = Proc(ROOT)
    try:
        victim("open_sender", name="v", connector=rig.connector, layout=FP32.to_dict(), num_blocks=P_BLOCKS, seed=5)
        victim("connect", name="v", address=rig.addr["fp32"])
        rid = rig.rid()
        rig.d("expect", name="fp32", rid=rid, dest=[56, 57, 58], timeout_s=2.0)
        victim("send", name="v", address=rig.addr["fp32"], rid=rid, src=[0, 1, 2], dest=[56, 57, 58], delay_s=0.3,
               background=True)
        time.sleep(0.45)  # mid-transfer: one or two of the four layers are out
    finally:
        victim.kill()
    events = rig.d("wait", name="fp32", rids=[rid], timeout_s=15)["events"]
    layers = [e for e in events if e["type"] == "LayerReceived"]
    assert 1 <= len(layers) < FP32.num_layers
    assert events[-1]["type"] == "TransferFailed" and "timed out" in events[-1]["reason"]
    rid, events, ok = rig.transfer("fp32", [9, 10, 11], [56, 57, 58])  # the receiver is fine
    assert ok and events[-1]["type"] == "TransferDone"


def test_layout_and_header_validation() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        replace(FP32, kv_cache_dtype="auto")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        replace(FP32, block_size=0)
    assert replace(FP32, head_dim=16).mismatches(FP32, "sender", "receiver") == ["head_dim: sender=16 receiver=8"]
    header = wire.kv_header(INT8, "r", 3, [5, 6])
    parsed = wire.parse_kv(wire.decode(header), INT8)
    assert (parsed.layer, parsed.dest_block_ids, parsed.scale_nbytes) == (3, [5, 6], 2 * INT8.scale_block_nbytes)
    for bad, why in [(b"\xc1", "not a msgpack message"), (msgpack.packb([1]), "must be a msgpack map"),
                     (msgpack.packb({"type": "kv", "v": 99}), "unsupported protocol version 99")]:
        with pytest.raises(wire.ProtocolError, match=why):
            wire.decode(bad)
    with pytest.raises(wire.ProtocolError, match="dtype 'int8' but the cache is 'float32'"):
        wire.parse_kv(wire.decode(header), FP32)
    with pytest.raises(wire.ProtocolError, match="shape"):
        wire.parse_kv(wire.decode(header), replace(INT8, head_dim=16))
    assert FP32.block_nbytes == 2 * 4 * 2 * 8 * 4 and INT8.block_nbytes == 2 * 4 * 2 * 8


def test_block_runs_and_id_checks() -> None:
    """One run for consecutive ids on both sides (the fast path), exact runs otherwise."""
    from kvtransfer.blocks import block_runs
    from kvtransfer.common import check_block_ids

    assert block_runs([5, 6, 7], [0, 1, 2]) == [(5, 0, 3)]
    assert block_runs([5, 6, 7], [0, 1, 3]) == [(5, 0, 2), (7, 3, 1)]
    assert block_runs([5, 7, 6], [0, 1, 2]) == [(5, 0, 1), (7, 1, 1), (6, 2, 1)]  # same span, not in order
    assert block_runs([1, 2, 3, 9], [4, 5, 6, 7]) == [(1, 4, 3), (9, 7, 1)]
    assert check_block_ids((3, 4), 5, "ids") == [3, 4]
    for bad, why in [([1, True], "list of ints"), ([1, 2.0], "list of ints"), ([0, 5], "out of range"),
                     ([2, 2], "duplicates"), ("12", "list of ints")]:
        with pytest.raises(ValueError, match=why):
            check_block_ids(bad, 5, "ids")


def test_orphaned_shm_segments_are_reaped(tmp_path: Path) -> None:
    """A SIGKILLed decode worker leaves its segment behind; the next allocation removes it, and only it."""
    from kvtransfer.shm_connector import FILE_PREFIX, allocate_shared_kv_caches

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"{FILE_PREFIX}{dead.stdout.strip()}-abc"
    alive = tmp_path / f"{FILE_PREFIX}{os.getppid()}-def"  # our parent: alive
    for f in (orphan, alive):
        f.write_bytes(b"x")
    _, _, handle = allocate_shared_kv_caches(FP32, 4, directory=str(tmp_path))
    try:
        assert not orphan.exists() and alive.exists() and os.path.exists(handle.path)
    finally:
        handle.close()
    assert not os.path.exists(handle.path)
