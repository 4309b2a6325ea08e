"""A prefill worker lends the KV blocks of a prompt's last chunk to the zmq sender, which sends them
without copying them out: the blocks must stay allocated (held) until D acknowledges the transfer,
and D must still receive exactly P's bytes — in one process, over real sockets."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from tiny_models import make_checkpoint

from kvtransfer import CONNECTORS, CacheLayout, TransferDone, TransferFailed, wire
from kvtransfer.receiver_io import Peer
from kvtransfer.zmq_connector import borrowed_parts
from prefill_svc.kv_connector import PrefillKVConnector
from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

FP32 = CacheLayout("tiny", "float32", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
INT8 = CacheLayout("tiny", "float32", "int8", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def _wait(rx, rid: str, timeout_s: float = 20.0) -> TransferDone | TransferFailed:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in rx.poll(50):
            if isinstance(ev, (TransferDone, TransferFailed)) and ev.request_id == rid:
                return ev
    raise AssertionError(f"no end of transfer for {rid}")


def _p_and_d(tmp_path, **p_config):
    path = make_checkpoint(str(tmp_path / "m"))
    small = dict(num_kv_blocks=64, block_size=8, max_model_len=256)
    p = LLMEngine(EngineConfig(model=path, role="prefill", **small, **p_config))
    d = LLMEngine(EngineConfig(model=path, role="decode", **small))
    rx = CONNECTORS["zmq"](timeout_s=30).make_receiver(d.kv_layout, d.runner.kv_caches, d.runner.kv_scales)
    tx = CONNECTORS["zmq"]().make_sender(p.kv_layout, "cpu")
    tx.connect(rx.address)
    conn = PrefillKVConnector(tx, p.config.block_size, p.kv_layout.num_layers)
    p.set_kv_connector(conn)
    return p, d, rx, tx, conn


def _prefill(p, conn, rx, prompt: list[int], dest: list[int]) -> str:
    rid = p.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=1))
    rx.expect(rid, dest)
    conn.expect_push(rid, rx.address, 0, dest)
    return rid


@pytest.mark.parametrize("chunk", [None, 8])
def test_lent_blocks_are_held_until_d_acknowledges(tmp_path, chunk) -> None:
    p, d, rx, tx, conn = _p_and_d(tmp_path, **({"max_num_batched_tokens": chunk} if chunk else {}))
    try:
        free_before = p.kv.pool.num_free
        prompt = list(range(3, 21))  # 18 tokens: 3 blocks of 8 (three chunks when chunked)
        dest = [40, 41, 42]
        rid = _prefill(p, conn, rx, prompt, dest)
        lent, send_layer = [], tx.send_layer

        def spy(*args, borrow=False):
            lent.append((args[5], borrow))  # (source blocks, borrowed?)
            send_layer(*args, borrow=borrow)
        tx.send_layer = spy
        while p.has_runnable():
            p.step()
        # Only the step that finishes the prompt lends its blocks: earlier chunks could be preempted.
        assert [b for _, b in lent] == ([False] * 4 if chunk else []) + [True] * 2
        # Finished, first token sampled; the sender may still read its blocks: they are held.
        assert rid in p.scheduler.held and rid in conn.held and conn.has_pending
        src = torch.tensor(p.scheduler.held[rid].block_ids)
        assert p.kv.pool.num_free == free_before - 3
        p.check_invariants()
        ev = _wait(rx, rid)  # D scatters the layers and acknowledges
        assert isinstance(ev, TransferDone) and ev.result["first_token"] >= 0
        deadline = time.monotonic() + 10
        while rid in p.scheduler.held and time.monotonic() < deadline:
            p.step()  # a step's poll releases what D acknowledged
            time.sleep(0.01)
        assert rid not in p.scheduler.held and not conn.has_pending
        assert p.kv.pool.num_free == free_before
        p.check_invariants()
        for layer in range(p.kv_layout.num_layers):  # free now, but nothing overwrote them yet
            assert torch.equal(d.runner.kv_caches[layer][torch.tensor(dest)], p.runner.kv_caches[layer][src])
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("end", ["disconnect", "close"])
def test_a_lost_receiver_fails_the_transfer_and_releases_the_lent_blocks(tmp_path, end) -> None:
    """disconnect: D restarted at the same address; close: the worker gives up the prefill role."""
    p, d, rx, tx, conn = _p_and_d(tmp_path)
    try:
        free_before = p.kv.pool.num_free
        rx.close()  # D is gone: no acknowledgement will ever come
        rid = _prefill(p, conn, rx, list(range(3, 15)), [10, 11])
        while p.has_runnable():
            p.step()
        assert rid in p.scheduler.held
        tx.disconnect(rx.address) if end == "disconnect" else tx.close()
        p.step()
        assert rid not in p.scheduler.held and p.kv.pool.num_free == free_before
        assert tx.stats.failures == 1
    finally:
        tx.close()


def test_borrowed_runs_and_frame_splits() -> None:
    cache = torch.arange(10 * 2 * 4 * 2 * 8, dtype=torch.float32).view(10, *FP32.block_shape)
    data, scale = borrowed_parts(cache, None, [2, 3, 4, 7, 1])
    assert [t.shape[0] for t in data] == [3, 1, 1] and scale == []
    assert all(t.data_ptr() == cache[s].data_ptr() for t, s in zip(data, [2, 7, 1]))  # views, no copy
    assert borrowed_parts(cache, None, list(range(0, 10, 2))) is not None
    assert borrowed_parts(cache.transpose(1, 2), None, [1, 2]) is None  # not contiguous: packed instead
    many = torch.zeros(200, *FP32.block_shape)
    assert borrowed_parts(many, None, list(range(0, 200, 2))) is None  # 100 runs: one packed copy instead

    rx = CONNECTORS["zmq"]().make_receiver(INT8, [torch.zeros(8, *INT8.block_shape, dtype=torch.int8)] * 2,
                                           [torch.zeros(8, *INT8.scale_block_shape)] * 2)
    try:
        header = wire.parse_kv(wire.decode(wire.kv_header(INT8, "r", 0, [5, 6, 7])), INT8)
        b, s = INT8.block_nbytes, INT8.scale_block_nbytes
        peer = Peer("s", b"x")

        def frames(*sizes: int) -> list[zmq.Frame]:
            return [zmq.Frame(bytes(n)) for n in sizes]
        rx._on_kv(b"x", peer, header, frames(2 * b, b, 2 * s, s), 0)  # two runs, their scales after them
        arrival = rx._inbox.get_nowait()
        assert [t.shape[0] for t in arrival.data] == [2, 1] and [t.shape[0] for t in arrival.scale] == [2, 1]
        for bad in [frames(3 * b, 3 * s + 4), frames(b + b // 2, b + b // 2, 3 * s), frames(2 * b, b, s, 2 * s),
                    frames(3 * b), frames(b, b, b, 3 * s), frames()]:
            with pytest.raises(wire.ProtocolError, match="do not split"):
                rx._on_kv(b"x", peer, header, bad, 0)
    finally:
        rx.close()


def test_a_silent_receiver_is_given_up_after_the_hold_timeout(tmp_path) -> None:
    """D died and never comes back: its in-flight transfers' lent blocks must not stay held for ever."""
    p, d, rx, tx, conn = _p_and_d(tmp_path)
    try:
        free_before = p.kv.pool.num_free
        conn.hold_timeout_s = 0.3
        address = rx.address
        rx.close()
        rid = _prefill(p, conn, rx, list(range(3, 15)), [10, 11])
        while p.has_runnable():
            p.step()
        p.step()
        assert rid in p.scheduler.held  # not yet: a live D acknowledges within a step or so
        time.sleep(0.4)
        p.step()
        assert rid not in p.scheduler.held and p.kv.pool.num_free == free_before
        assert tx.stats.failures == 1
        with pytest.raises(ValueError, match="not connected"):  # given up: the next prefill handshakes anew
            tx.send_layer(address, "next", 0, p.runner.kv_caches[0], None, [0], [0])
        late = _prefill(p, conn, rx, list(range(3, 15)), [10, 11])  # queued for D before it was given up
        outs = []
        while p.has_runnable():
            outs += p.step()  # the push is dropped (logged); the engine keeps serving
        assert [o.request_id for o in outs if o.finished] == [late] and late not in conn.outbound
        assert late not in p.scheduler.held and p.kv.pool.num_free == free_before
    finally:
        tx.close()


def test_replacing_a_sending_connector_drops_its_layer_hook(tmp_path) -> None:
    """A prefill worker switched to decode gets a connector that sends nothing: the old sender's
    per-layer hook must go with it (it kept the old connector alive, ran every layer of every decode
    step, and on a GPU keeps decode steps off CUDA graphs)."""
    from tandem.engine.kv_connector import KVConnector

    p, _, rx, tx, conn = _p_and_d(tmp_path)
    try:
        assert p.runner.layer_hook is not None
        p.set_kv_connector(KVConnector())
        assert p.runner.layer_hook is None
        p.set_kv_connector(conn)  # and back: the sender's hook returns
        assert p.runner.layer_hook is not None
    finally:
        tx.close()
        rx.close()
