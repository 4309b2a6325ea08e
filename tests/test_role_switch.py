"""Live P:D changes through the router's admin API, as real processes: a worker moved to the other
role under load (no restart, prefix cache kept), a worker drained under load, and the refusals.

Cluster: router (--enable-admin), prefill p2 and decode d1 first (a prompt is prefilled on p2 so
its blocks sit in p2's prefix cache), then prefill p1. While clients stream greedy requests:
p2 -> decode, d1 -> prefill (and onto its --switch-cpus core), then p1 is drained. Every request
completes with the offline engine's greedy output; the drained worker exits 0; the KV invariant
holds on every survivor; p2, now the only decode worker, serves the warm prompt from the blocks it
cached as a prefill worker.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request

import pytest
from service_procs import Proc, get_json, metric_value, post, router_endpoints, start_router, stop_all, wait_workers
from service_procs import worker_stats as stats_of
from tiny_models import make_checkpoint

from tandem.cli import cpus

pytestmark = pytest.mark.slow

ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "512"]
WARM = "The history of the city begins with a small market by the river, where traders from the hills"


def _worker(role: str, wid: str, ckpt: str, router: str, logs, *extra: str) -> Proc:
    return Proc(wid, [sys.executable, "-m", "tandem.cli", role, "--model", ckpt, "--listen", "tcp://127.0.0.1:0",
                      "--router", router, "--worker-id", wid, "--local-prefill-threshold", "0", *ENGINE, *extra],
                logs)


def _cpus_of(proc: Proc) -> set[int]:
    """The affinity mask the kernel reports for a worker process."""
    with open(f"/proc/{proc.popen.pid}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    return set(cpus.parse_cpuset(line.split(":", 1)[1].strip()))


def _admin(http: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    if path.endswith("/drain"):
        data = b"{}"
    req = urllib.request.Request(f"{http}/admin/workers{path}", data, {"Content-Type": "application/json"},
                                 method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _roles(http: str) -> dict[str, str]:
    status, body = _admin(http, "")
    assert status == 200, body
    return {w["worker_id"]: w["role"] for w in body["data"] if w["alive"] and not w["stats"].get("draining")}


def _wait(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Load:
    """Client threads sending greedy completions until stopped; every answer is checked later."""

    def __init__(self, http: str, prompts: list[str], threads: int = 4) -> None:
        self.http, self.prompts, self.results, self.errors = http, prompts, [], []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = i
        while not self.stop.is_set():
            prompt = self.prompts[n % len(self.prompts)]
            n += len(self.threads)
            status, _, body = post(f"{self.http}/v1/completions",
                                   {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            (self.results if status == 200 else self.errors).append((prompt, status, body))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def test_role_switch_and_drain_under_load(tmp_path):
    from tandem import LLM, SamplingParams

    ckpt = make_checkpoint(str(tmp_path / "ckpt"))
    logs = tmp_path / "logs"
    logs.mkdir()
    router = start_router("router", ckpt, logs, "--enable-admin")
    off = start_router("off", ckpt, logs)
    procs = [router, off]
    try:
        ep = router_endpoints(router)
        http = ep["http"]
        mask = sorted(cpus.available())
        home, away = mask[0], mask[-1]  # d1 moves between them (one core: both the same, still checked)
        d1 = _worker("decode", "d1", ckpt, ep["listen"], logs, "--cpus", str(home), "--switch-cpus", str(away))
        procs += [_worker("prefill", "p2", ckpt, ep["listen"], logs), d1]
        wait_workers(http, decode=1, prefill=1)
        assert _cpus_of(d1) == {home}
        prompts = [f"{WARM} number {i}:" for i in range(6)]
        offline = LLM(ckpt, num_kv_blocks=256, max_model_len=512)
        expected = {p: o.text for p, o in zip(
            [WARM, *prompts], offline.generate([WARM, *prompts], SamplingParams(temperature=0, max_tokens=24,
                                                                                 ignore_eos=True)))}
        status, _, body = post(f"{http}/v1/completions", {"prompt": WARM, "max_tokens": 24, "temperature": 0,
                                                          "ignore_eos": True})
        assert status == 200 and body["choices"][0]["text"] == expected[WARM]  # WARM's blocks now cached on p2
        p1 = _worker("prefill", "p1", ckpt, ep["listen"], logs)
        procs.append(p1)
        wait_workers(http, decode=1, prefill=2)

        # refusals, before any change
        assert _admin(http, "/nobody/role", {"role": "decode"})[0] == 404
        status, body = _admin(http, "/p2/role", {"role": "both"})
        assert status == 400 and body["error"]["param"] == "role"
        assert _admin(http, "/p2/role", {"role": "prefill"})[0] == 409  # already prefill
        status, body = _admin(http, "/d1/role", {"role": "prefill"})
        assert status == 409 and "last routable decode worker" in body["error"]["message"]
        status, body = get_json(f"{router_endpoints(off)['http']}/admin/workers")
        assert status == 404 and "--enable-admin" in body["error"]["message"]

        load = Load(http, prompts)
        time.sleep(1.0)
        assert _admin(http, "/p2/role", {"role": "decode"})[0] == 202
        _wait(lambda: _roles(http).get("p2") == "decode", "p2 to serve as decode")
        time.sleep(1.0)
        assert _admin(http, "/d1/role", {"role": "prefill"})[0] == 202
        _wait(lambda: _roles(http).get("d1") == "prefill", "d1 to serve as prefill")
        assert _cpus_of(d1) == {away}  # tandem up's --switch-cpus: the prefill role's core
        time.sleep(1.0)
        assert _admin(http, "/p1/drain")[0] == 202
        assert p1.popen.wait(60) == 0  # drained: finished what it had, deregistered, exited 0
        time.sleep(1.0)
        load.finish()

        assert not load.errors, load.errors[:3]
        assert len(load.results) >= 12
        wrong = [p for p, _, body in load.results if body["choices"][0]["text"] != expected[p]]
        assert not wrong, f"{len(wrong)} of {len(load.results)} answers differ from the offline engine"
        assert _roles(http) == {"p2": "decode", "d1": "prefill"}
        assert metric_value(http, "tandem_router_role_changes_total") == 2
        assert metric_value(http, "tandem_router_drains_total") == 1
        # p2 kept its prefix cache across the switch: as the only decode worker it finds WARM's blocks
        cached_before = metric_value(http, "tandem_router_cached_prompt_tokens_total")
        status, _, body = post(f"{http}/v1/completions", {"prompt": WARM, "max_tokens": 24, "temperature": 0,
                                                          "ignore_eos": True})
        assert status == 200 and body["choices"][0]["text"] == expected[WARM]
        assert metric_value(http, "tandem_router_cached_prompt_tokens_total") - cached_before >= 16
        workers = {w["worker_id"]: w for w in _admin(http, "")[1]["data"]}
        for wid in ("p2", "d1"):
            assert stats_of(workers[wid]["address"])["kv_invariant_ok"], wid
        # the KV receiver address follows the role: p2 registered one on becoming decode (P is told its
        # address when it is lost), d1 dropped its own on becoming prefill
        assert workers["p2"]["kv_address"].startswith("tcp://") and workers["d1"]["kv_address"] is None
        # now each role has one worker left: neither may be drained or switched
        assert _admin(http, "/p2/drain")[0] == 409 and _admin(http, "/d1/role", {"role": "decode"})[0] == 409
    finally:
        stop_all(procs)
