"""Multi-host serving for real: the router, a prefill worker and two decode workers each on its own
network-namespace host (tests/netns_hosts.py: own address on a bridge, never loopback), started by
the per-role commands (`tandem router`, `tandem prefill`, `tandem decode`) with CURVE links from one
shared TANDEM_LINK_SECRET. The test process is the client, on the bridge's own address.

- P/D requests served across the hosts equal transformers' greedy output token for token, and every
  process listens only on the address it was given.
- One decode host's cable is cut mid-stream: its streams migrate and still equal the greedy output,
  the router drops the worker within seconds (measured), and after the cable is back the worker is
  registered again and serves.
- Bad registrations: a worker advertising an address the router cannot reach, and a second worker
  with an id already in use, are refused and logged with a message naming them; serving goes on.

`tandem launch` over ssh against the same kind of hosts is tests/test_multihost_launch.py. The last
results are in docs/DEPLOYMENT.md ("Multi-host").
"""

from __future__ import annotations

import random
import secrets
import sys
import threading
import time

import pytest
from netns_hosts import Hosts, unavailable
from service_procs import Proc, get_json, metric_value, step_hook_env, stop_all
from tiny_models import hf_greedy, make_checkpoint

pytestmark = pytest.mark.slow

ENGINE = ["--num-kv-blocks", "512", "--max-model-len", "1024"]
MAX_TOKENS = 48
STEP_DELAY = 0.05  # seconds per decode step: streams last ~2.5 s, long enough to cut a cable under them
PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(40 + 7 * i)] for i in range(4)]
AFTER = [[random.Random(100 + i).randrange(3, 512) for _ in range(50 + 5 * i)] for i in range(4)]
RESULTS: dict[str, object] = {}  # numbers for docs/DEPLOYMENT.md, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def net():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with Hosts(4) as hosts:  # router, prefill, decode d1, decode d2
        yield hosts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="module")
def expected(ckpt):
    return hf_greedy(ckpt, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def expected_after(ckpt):
    return hf_greedy(ckpt, AFTER, MAX_TOKENS)


def tandem(net, host, *args: str) -> list[str]:
    return net.argv(host, [sys.executable, "-m", "tandem.cli", *args])


def start_worker(net, host, role: str, name: str, ckpt: str, router: str, log_dir, *flags: str) -> Proc:
    port = {"prefill": 6000, "decode": 6100}[role]
    kv = ["--kv-listen", f"tcp://{host.addr}:6200"] if role == "decode" else []
    env = step_hook_env(log_dir / f"hook-{name}", delay=STEP_DELAY) if role == "decode" else {}
    return Proc(name, tandem(net, host, role, "--model", ckpt, "--kv-connector", "zmq", "--listen",
                             f"tcp://{host.addr}:{port}", *kv, "--router", router, "--worker-id", name, *ENGINE,
                             *flags), log_dir, {**env, "TANDEM_LINK_SECRET": SECRET})


SECRET = secrets.token_hex(32)


@pytest.fixture(scope="module")
def cluster(net, ckpt, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    r, p, d1, d2 = net.hosts
    router = Proc("router", tandem(net, r, "router", "--model", ckpt, "--host", r.addr, "--http-port", "8000",
                                   "--grpc-port", "50051", "--listen", f"tcp://{r.addr}:5557"),
                  log_dir, {"TANDEM_LINK_SECRET": SECRET})
    procs = [router]
    try:
        router.wait_for(r"listen\s+tcp:")
        registration = f"tcp://{r.addr}:5557"
        procs += [start_worker(net, p, "prefill", "p1", ckpt, registration, log_dir),
                  start_worker(net, d1, "decode", "d1", ckpt, registration, log_dir),
                  start_worker(net, d2, "decode", "d2", ckpt, registration, log_dir)]
        http = f"http://{r.addr}:8000"
        wait_live(http, {"d1", "d2", "p1"})
        yield {"http": http, "grpc": f"{r.addr}:50051", "registration": registration, "log_dir": log_dir,
               "procs": {proc.name: proc for proc in procs}}
    finally:
        stop_all(procs)


def live_ids(http: str) -> set[str]:
    _, health = get_json(f"{http}/health")
    return {w["worker_id"] for w in health["workers"] if w["alive"] and w.get("reachable", True)}


def wait_live(http: str, want: set[str], timeout: float = 90) -> float:
    """Seconds until exactly `want` are the live workers."""
    t0 = time.monotonic()
    while (got := live_ids(http)) != want:
        assert time.monotonic() - t0 < timeout, f"live workers {got}, expected {want}"
        time.sleep(0.05)
    return time.monotonic() - t0


def worker(http: str, wid: str) -> dict:
    _, health = get_json(f"{http}/health")
    return next(w for w in health["workers"] if w["worker_id"] == wid)


def generate(target: str, prompt: list[int], on_token=None) -> list[int]:
    """One greedy gRPC stream (token ids in and out); `on_token(n)` after each message, n tokens so far."""
    from service_procs import grpc_stub

    from tandem.protocol import generation_pb2 as pb

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    for response in grpc_stub(target).Generate(request, timeout=120):
        tokens += response.token_ids
        if on_token is not None:
            on_token(len(tokens))
    return tokens


def generate_all(target: str, prompts: list[list[int]], on_token=None) -> list[list[int] | BaseException]:
    """The prompts as concurrent streams; `on_token(i, n)` after each message of stream i."""
    outs: list[list[int] | BaseException] = [[] for _ in prompts]

    def one(i: int) -> None:
        try:
            outs[i] = generate(target, prompts[i], None if on_token is None else lambda n: on_token(i, n))
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's assertion
            outs[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return outs


def test_serves_across_hosts_and_binds_only_given_addresses(net, cluster, expected):
    assert generate_all(cluster["grpc"], PROMPTS) == expected
    http = cluster["http"]
    served = {wid: worker(http, wid)["stats"].get("remote_prefills", 0) for wid in ("d1", "d2")}
    assert all(served.values()), served  # both decode hosts served, with KV from the prefill host
    for host in net.hosts:  # nothing on 0.0.0.0 or loopback: each process binds its host's address only
        bound = [a.replace("[::ffff:", "").replace("]", "") for a in net.listening(host)]  # gRPC's v4-mapped form
        assert bound and all(a.startswith(f"{host.addr}:") for a in bound), (host.ns, bound)


def test_link_cut_mid_stream_migrates_and_the_host_returns(net, cluster, expected, expected_after):
    http, (_, _, d1_host, _) = cluster["http"], net.hosts
    migrations0 = metric_value(http, "tandem_router_migrations_total")
    cut_at: list[float] = []
    on_d1: list[int] = []

    def on_token(i: int, n: int) -> None:
        # the first stream past 8 tokens triggers the cut once all four are running
        if n >= 8 and not cut_at and worker(http, "d1")["inflight"] >= 1:
            on_d1.append(worker(http, "d1")["inflight"])
            net.cut(d1_host)
            cut_at.append(time.monotonic())

    detected: list[float] = []

    def watch() -> None:
        while not cut_at:
            time.sleep(0.01)
        while "d1" in live_ids(http):
            time.sleep(0.05)
        detected.append(time.monotonic() - cut_at[0])

    watcher = threading.Thread(target=watch)
    watcher.start()
    outs = generate_all(cluster["grpc"], PROMPTS, on_token)
    watcher.join(30)
    assert cut_at and detected, "the cable was never cut, or the router never noticed"
    assert outs == expected  # every stream finished, and equals the uninterrupted greedy output
    migrated = metric_value(http, "tandem_router_migrations_total") - migrations0
    assert migrated >= on_d1[0] >= 1
    assert detected[0] < 5.0, f"the router took {detected[0]:.2f}s to notice the cut"
    assert live_ids(http) == {"p1", "d2"}
    time.sleep(2)  # keep the cable out a little longer: TCP's retransmission timer backs off meanwhile
    net.restore(d1_host)
    back = wait_live(http, {"p1", "d1", "d2"}, timeout=60)
    routed = metric_value(http, "tandem_router_routing_decisions_total", worker="d1", role="decode")
    # new prompts (not in any prefix cache), so each needs KV from the prefill host again
    assert generate_all(cluster["grpc"], AFTER) == expected_after
    assert metric_value(http, "tandem_router_routing_decisions_total", worker="d1", role="decode") > routed, \
        "d1 came back but was given nothing"
    RESULTS.update(detect_s=round(detected[0], 2), streams_on_cut_host=on_d1[0], migrations=int(migrated),
                   back_after_restore_s=round(back, 2), outputs_equal=True)
    print(f"\nmultihost link cut: {RESULTS}")


def test_bad_registrations_are_refused_by_name_and_serving_goes_on(net, cluster, ckpt, expected):
    http, registration, log_dir = cluster["http"], cluster["registration"], cluster["log_dir"]
    p_host = net.hosts[1]
    ghost = f"{net.subnet}.99"  # on the bridge's subnet, but no host answers there
    refused0 = {r: metric_value(http, "tandem_router_registrations_refused_total", reason=r)
                for r in ("unreachable", "duplicate_id")}
    extra = [Proc("d-ghost", tandem(net, p_host, "decode", "--model", ckpt, "--kv-connector", "zmq", "--listen",
                                    f"tcp://{p_host.addr}:6300", "--advertise", f"tcp://{ghost}:6300", "--router",
                                    registration, "--worker-id", "d-ghost", *ENGINE), log_dir,
                  {"TANDEM_LINK_SECRET": SECRET}),
             Proc("d2-again", tandem(net, p_host, "decode", "--model", ckpt, "--kv-connector", "zmq", "--listen",
                                     f"tcp://{p_host.addr}:6400", "--router", registration, "--worker-id", "d2",
                                     *ENGINE), log_dir, {"TANDEM_LINK_SECRET": SECRET})]
    try:
        extra[1].wait_for(r"(?m)^(?=.*router refused our registration)(?=.*'d2' is in use by a live decode worker)",
                          timeout=120)
        extra[0].wait_for(rf"(?m)^(?=.*router refused our registration)(?=.*'d-ghost' advertises control address "
                          rf"tcp://{ghost}:6300, which the router cannot reach)", timeout=120)
        router_log = cluster["procs"]["router"].log.read_text()
        assert "registration refused" in router_log and "d-ghost" in router_log
        assert metric_value(http, "tandem_router_registrations_refused_total", reason="unreachable") > \
            refused0["unreachable"]
        assert metric_value(http, "tandem_router_registrations_refused_total", reason="duplicate_id") > \
            refused0["duplicate_id"]
        assert worker(http, "d2")["address"] == f"tcp://{net.hosts[3].addr}:6100"  # the first d2 keeps its id
        assert live_ids(http) == {"p1", "d1", "d2"}  # neither newcomer is routable
        assert generate_all(cluster["grpc"], PROMPTS) == expected  # and everyone else is served as before
        assert all(proc.popen.poll() is None for proc in extra)  # refused workers wait, asking again
    finally:
        stop_all(extra)
