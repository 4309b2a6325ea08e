"""Worker links under ZMQ CURVE (tandem/protocol/security.py, `tandem keys`, `--link-keys`).

In-process: a CURVE server admits a client holding the cluster key and never delivers a frame from
a plain (unauthenticated) peer or from a peer with another key; each refused key is logged once.
Real processes: a router, a prefill and a decode worker started with `--link-keys DIR` serve a P/D
request (output equal to the offline engine's); a rogue peer without the key cannot register with
the router, submit to the decode worker, or open a KV link to it; a worker with another key
directory never joins the cluster.
"""

from __future__ import annotations

import io
import json
import logging
import os
import stat
import subprocess
import sys
import time

import msgpack
import pytest
import structlog
import zmq
from service_procs import ENV, ROOT, Proc, get_json, post, router_endpoints, start_router, stop_all, wait_workers

from tandem.observability.logging import configure_logging
from tandem.protocol import security
from tandem.protocol.codec import PROTOCOL_VERSION


@pytest.fixture
def log_lines():
    """This process's log lines, JSON, into a buffer for the test (restored after): reading captured stdout
    instead passed or failed with whatever an earlier test in the same process had pointed logging at."""
    root, config = logging.getLogger(), structlog.get_config()
    handlers, level, buf = root.handlers[:], root.level, io.StringIO()
    configure_logging("info", json=True, stream=buf)
    yield lambda: buf.getvalue().splitlines()
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


@pytest.fixture
def secured():
    keys = security.from_secret("a-test-secret-of-enough-length")
    security.configure(keys)
    yield keys
    security.configure(None)


def _frame(msg_type: str, **fields) -> bytes:
    return msgpack.packb({"type": msg_type, "v": PROTOCOL_VERSION, **fields})


def _rogue(address: str, keys: security.LinkKeys | None = None, server_key: bytes | None = None) -> zmq.Socket:
    """A DEALER on its own context (no ZAP handler, no process-wide keys): plain, or CURVE with `keys`."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, keys.public, keys.secret
    sock.connect(address)
    return sock


def _offer(sock: zmq.Socket, data: bytes, seconds: float = 2.0) -> None:
    """Queue `data` on a rogue socket without ever blocking the test. When the server refuses the handshake
    (a mechanism mismatch or a wrong key is a ZMTP protocol error) libzmq terminates the connecting session and
    its pipe instead of reconnecting, so a DEALER whose refusal came before its send has nowhere to queue and a
    blocking send waits forever (a CI run hung 600 s here). A frame that never leaves is refused all the same;
    what the tests assert is that none is delivered."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            sock.send(data, zmq.NOBLOCK)
            return
        except zmq.Again:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def test_curve_admits_the_cluster_key_only(secured, log_lines):
    ctx = zmq.Context()
    server = security.server(ctx.socket(zmq.ROUTER))
    port = server.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    member = security.client(ctx.socket(zmq.DEALER))
    member.connect(address)
    member.send(b"member")
    assert server.poll(3000) and server.recv_multipart()[1] == b"member"
    wrong = security.from_secret("another-secret-entirely-xyz")
    rogues = [_rogue(address), _rogue(address, wrong, secured.public), _rogue(address, wrong, secured.public)]
    for r in rogues:
        _offer(r, b"rogue")
    assert not server.poll(1500), "a frame from a peer without the cluster key was delivered"
    # the member's link still works after the refusals
    member.send(b"still here")
    assert server.poll(3000) and server.recv_multipart()[1] == b"still here"
    refused = [line for line in log_lines() if "refused a link peer" in line]
    assert len(refused) == 1 and wrong.public.decode() in refused[0], refused  # one key, logged once
    for s in (*rogues, member, server):
        s.close(0)
    security.release(ctx)
    ctx.term()


def test_secret_and_directory_keys(tmp_path):
    a, b = security.from_secret("same-secret-for-all-1234"), security.from_secret("same-secret-for-all-1234\n")
    assert a == b and a.public == zmq.curve_public(a.secret)  # a trailing newline from a secret file is not part of it
    assert security.from_secret("other-secret-for-all-1234").public != a.public
    with pytest.raises(ValueError, match="at least 16 characters"):
        security.from_secret("short")
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "keys", str(tmp_path / "keys")], capture_output=True,
                         text=True, env=ENV, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    secret_file = tmp_path / "keys" / "cluster.key_secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    keys = security.from_directory(tmp_path / "keys")
    assert keys.public in keys.allowed and keys.public == zmq.curve_public(keys.secret)
    again = subprocess.run([sys.executable, "-m", "tandem.cli", "keys", str(tmp_path / "keys")], capture_output=True,
                           text=True, env=ENV, cwd=ROOT, timeout=60)
    assert again.returncode == 2 and "already holds cluster keys" in again.stderr
    assert security.from_directory(tmp_path / "keys") == keys  # refused, so nothing was replaced
    with pytest.raises(ValueError, match="tandem keys"):
        security.from_directory(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not both"):
        security.from_options(str(tmp_path / "keys"), str(secret_file))


def _keys_dir(tmp_path, name: str) -> str:
    subprocess.run([sys.executable, "-m", "tandem.cli", "keys", str(tmp_path / name)], check=True, env=ENV,
                   cwd=ROOT, capture_output=True, timeout=60)
    return str(tmp_path / name)


def _worker(role: str, ckpt: str, router: str, logs, keys: str, name: str) -> Proc:
    extra = ["--local-prefill-threshold", "0"] if role == "decode" else []
    return Proc(name, [sys.executable, "-m", "tandem.cli", role, "--model", ckpt, "--listen", "tcp://127.0.0.1:0",
                       "--router", router, "--worker-id", name, "--num-kv-blocks", "256", "--link-keys", keys,
                       *extra], logs)


@pytest.mark.slow
def test_cluster_with_link_keys_serves_and_refuses_rogues(tmp_path):
    from tiny_models import make_checkpoint

    from tandem import LLM, SamplingParams

    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    keys, other_keys = _keys_dir(tmp_path, "keys"), _keys_dir(tmp_path, "other-keys")
    logs = tmp_path / "logs"
    logs.mkdir()
    router = start_router("router", ckpt, logs, "--link-keys", keys)
    procs = [router]
    try:
        ep = router_endpoints(router)
        prefill = _worker("prefill", ckpt, ep["listen"], logs, keys, "p1")
        decode = _worker("decode", ckpt, ep["listen"], logs, keys, "d1")
        outsider = _worker("decode", ckpt, ep["listen"], logs, other_keys, "outsider")
        procs += [prefill, decode, outsider]
        d_ready = json.loads(decode.wait_for(r"tandem-decode-ready (\{.*\})").group(1))
        outsider.wait_for(r"tandem-decode-ready")
        wait_workers(ep["http"], decode=1, prefill=1)

        prompt = "def main():\n    return"
        status, _, body = post(f"{ep['http']}/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})
        expected = LLM(ckpt, num_kv_blocks=256).generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
        assert status == 200 and body["choices"][0]["text"] == expected.text

        # rogue peers: a plain socket and one with a CURVE key of its own
        wrong = security.from_directory(other_keys)
        cluster_public = security.from_directory(keys).public
        for peer in (None, wrong):
            reg = _rogue(ep["listen"], peer, cluster_public)
            _offer(reg, _frame("register", worker_id="rogue", role="decode", control_address="tcp://127.0.0.1:1",
                               model="x", interval_ms=500))
            ctl = _rogue(d_ready["control"], peer, cluster_public)
            _offer(ctl, _frame("stats"))
            kv = _rogue(d_ready["kv"], peer, cluster_public)
            _offer(kv, b"not even a KV frame")
            assert not ctl.poll(1500), "the decode worker answered a peer without the cluster key"
            for s in (reg, ctl, kv):
                s.close(0)
        time.sleep(1.5)  # an outsider or rogue that registered would show up within a heartbeat or two
        _, health = get_json(f"{ep['http']}/health")
        assert health["live_workers"] == {"decode": 1, "prefill": 1}, health
        # the cluster still serves, and the decode worker kept its KV invariant
        status, _, body = post(f"{ep['http']}/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == expected.text
        assert "refused a link peer" in router.log.read_text()
        assert "refused a link peer" in decode.log.read_text()
        told = outsider.log.read_text()  # the outsider is told why, not left guessing (a log line, not a traceback)
        assert '"event": "the peer refused this link' in told and "Traceback" not in told, told[-2000:]
    finally:
        stop_all(procs)


def test_launch_secures_an_all_local_cluster_by_default():
    from tandem.cli.launch import plan
    from tandem.cli.launch_config import validate

    local = {"host": "localhost", "prefill": {"count": 1}, "decode": {"count": 1}}
    router, workers = plan(validate({"router": {"host": "localhost"}, "hosts": [local]}))
    secrets = {p.env.get(security.SECRET_ENV) for p in (router, *workers)}
    assert len(secrets) == 1 and len(secrets.pop() or "") == 64  # one fresh secret, in every process's environment
    assert all("--link-keys" not in p.argv for p in (router, *workers))  # never on a command line
    open_router, _ = plan(validate({"router": {"host": "localhost"}, "insecure_links": True, "kv_connector": "none",
                                    "hosts": [{"host": "localhost", "decode": {"count": 1}}]}))
    assert security.SECRET_ENV not in open_router.env
    assert os.environ.get(security.SECRET_ENV) is None  # planning did not leak it into this process
