"""Cores shared out, not fought over: the CPU plan, `--cpus`, and `tandem up` on this machine (read back
from /proc: disjoint affinity masks, thread counts that add up to at most the cores there are)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from service_procs import ENV, ROOT, Proc

from tandem.cli import cpus


def test_plan_splits_the_budget_into_disjoint_slices():
    assert cpus.plan(["p", "d"], [0, 1, 2, 3, 4]) == {"p": [0, 1], "d": [2, 3, 4]}  # decode gets the remainder
    assert cpus.plan(["p", "d1", "d2"], [4, 5, 6, 7, 8, 9]) == {"p": [4, 5], "d1": [6, 7], "d2": [8, 9]}
    assert cpus.plan(["p", "d"], [0, 1, 2, 3], per_worker=1) == {"p": [0], "d": [1]}
    assert cpus.plan(["a", "b", "c"], [0, 1]) == {"a": [0], "b": [1], "c": [0]}  # must share: one core each


def test_more_workers_than_cores_share_cores_within_a_role_only():
    p1d2 = cpus.plan(["prefill-0", "decode-0", "decode-1"], [0, 1])
    assert p1d2 == {"prefill-0": [0], "decode-0": [1], "decode-1": [1]}  # prefill never time-slices with decode
    assert cpus.plan(["prefill-0", "prefill-1", "decode-0"], [0, 1]) == {
        "prefill-0": [0], "prefill-1": [0], "decode-0": [1]}
    colocated = cpus.plan(["decode-0", "decode-1", "decode-2"], [0, 1])  # one role: round-robin
    assert colocated == {"decode-0": [0], "decode-1": [1], "decode-2": [0]}
    wide = cpus.plan(["prefill-0"] + [f"decode-{i}" for i in range(5)], [4, 5, 6, 7])  # cores follow worker counts
    assert wide["prefill-0"] == [4] and \
        sorted({tuple(c) for n, c in wide.items() if n != "prefill-0"}) == [(5,), (6,), (7,)]
    assert cpus.plan(["prefill-0", "decode-0", "decode-1"], [3]) == {  # fewer cores than roles: all share
        "prefill-0": [3], "decode-0": [3], "decode-1": [3]}


def test_role_aware_shares_follow_tandem_ups_plan():
    """tandem launch passes "i/n:p" (the first p of the host's n workers are prefill): past the host's
    core count the worker takes tandem up's role-grouped core and knows where a role switch moves it."""
    assert [cpus.resolve(f"{i}/3:1", allowed=[0, 1]) for i in range(3)] == [[0], [1], [1]]
    assert [cpus.switch_share(f"{i}/3:1", allowed=[0, 1]) for i in range(3)] == [[1], [0], [0]]
    assert [cpus.resolve(f"{i}/3", allowed=[0, 1]) for i in range(3)] == [[0], [1], [0]]  # roles unknown
    assert cpus.switch_share("1/3", allowed=[0, 1]) is None
    assert cpus.resolve("1/2:1", allowed=[0, 1, 2, 3]) == cpus.plan(["prefill-0", "decode-0"], [0, 1, 2, 3])[
        "decode-0"]
    assert cpus.switch_share("1/2:1", allowed=[0, 1, 2, 3]) is None  # cores of its own: it keeps them
    with pytest.raises(ValueError, match="p <= n"):
        cpus.resolve("0/2:3", allowed=[0, 1])


def test_a_switched_worker_moves_to_the_other_roles_least_shared_core():
    """tandem up passes these as --switch-cpus: after a role switch, still no core with both roles."""
    p1d2 = cpus.plan(["prefill-0", "decode-0", "decode-1"], [0, 1])
    assert cpus.switch_targets(p1d2) == {"prefill-0": [1], "decode-0": [0], "decode-1": [0]}
    wide = cpus.plan(["prefill-0", "prefill-1", "prefill-2"] + [f"decode-{i}" for i in range(4)], [0, 1, 2, 3])
    moves = cpus.switch_targets(wide)
    for name, cores in wide.items():
        other = {c for n, cs in wide.items() if n.split("-")[0] != name.split("-")[0] for c in cs}
        assert moves[name][0] in other, name
    counts = {c: sum(c in cs for cs in wide.values()) for c in range(4)}
    assert moves["prefill-0"] == [min((c for c in range(4) if c in {x for n, cs in wide.items()
                                                                    if n.startswith("decode") for x in cs}),
                                      key=lambda c: counts[c])]
    assert cpus.switch_targets(cpus.plan(["prefill-0", "decode-0"], [0, 1])) == {}  # own cores: keep them
    assert cpus.switch_targets(cpus.plan(["decode-0", "decode-1", "decode-2"], [0, 1])) == {}  # one role


def test_cgroup_quota_caps_the_budget(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    for text, cores in (("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000\n", 1), ("400000 100000", 4)):
        cpu_max.write_text(text)
        assert cpus.cgroup_cpu_limit(str(cpu_max)) == cores
    assert cpus.cgroup_cpu_limit(str(tmp_path / "absent")) is None


def test_budget_is_the_mask_capped_by_omp_num_threads():
    mask = cpus.available()[:cpus.cgroup_cpu_limit() or None]
    assert cpus.budget({}) == mask
    assert cpus.budget({"OMP_NUM_THREADS": "1"}) == mask[:1]
    assert cpus.budget({"OMP_NUM_THREADS": "4096"}) == mask
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two' is not a positive integer"):
        cpus.budget({"OMP_NUM_THREADS": "two"})


def test_cpuset_and_share_specs():
    assert cpus.parse_cpuset("0-2,5, 7") == [0, 1, 2, 5, 7]
    assert cpus.format_cpuset([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpus.resolve("1/2", allowed=[0, 1, 2, 3]) == [2, 3]
    assert cpus.resolve("2/3", allowed=[0, 1, 2, 3]) == [2, 3]
    assert cpus.resolve("2/3", allowed=[0, 1]) == [0]  # more workers than cores
    for spec, message in (("", "is empty"), ("a-b", "is not a core number"), ("3-1", "is empty"),
                          ("2/2", "0 <= i < n"), ("0-99999", "not available to this process")):
        with pytest.raises(ValueError, match=message):
            cpus.resolve(spec, allowed=[0, 1])


@pytest.mark.slow
@pytest.mark.parametrize("argv,message", [
    (["up", "--cpus-per-worker", "9999"], "--cpus-per-worker 9999 x 2 workers needs 19998 cores"),
    (["up", "--cpus-per-worker", "0"], "--cpus-per-worker must be >= 1"),
    (["decode", "--cpus", "0-99999", "--kv-connector", "none"], "not available to this process"),
    (["decode", "--cpus", "", "--kv-connector", "none"], "is empty"),
    (["decode", "--switch-cpus", "0-99999", "--kv-connector", "none"], "--switch-cpus 0-99999: cores"),
])
def test_bad_cpu_requests_exit_2_with_one_line(argv, message):
    out = subprocess.run([sys.executable, "-m", "tandem.cli", *argv], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert message in last and last.startswith("tandem "), out.stderr


def _allowed(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    return cpus.parse_cpuset(line.split(":", 1)[1].strip())


@pytest.mark.parametrize("omp", [None, str(len(cpus.available()))], ids=["omp-unset", "omp-exported"])
def test_tandem_up_gives_workers_disjoint_cores(tmp_path, omp):
    # exported, OMP_NUM_THREADS is the budget for all of tandem, not a per-worker count
    up = Proc("up", [sys.executable, "-m", "tandem.cli", "up", "--http-port", "0", "--grpc-port", "0", "--quiet"],
              tmp_path, env={"OMP_NUM_THREADS": omp})
    try:
        ready = json.loads(up.wait_for(r"tandem-up-ready (\{.*\})", timeout=180).group(1))
        workers = ready["workers"]
        masks = {name: _allowed(w["pid"]) for name, w in workers.items()}
        threads = {name: w["threads"] for name, w in workers.items()}
        n = len(cpus.available())
        assert sum(threads.values()) <= max(n, len(workers)), threads
        for name, mask in masks.items():
            assert threads[name] == len(mask) and cpus.format_cpuset(mask) == workers[name]["cpus"]
        if n >= len(workers):
            everything = [c for mask in masks.values() for c in mask]
            assert len(everything) == len(set(everything)), f"overlapping masks: {masks}"
        assert "cpu plan: " in up.log.read_text()
    finally:
        up.stop(timeout=30)
    assert up.popen.returncode == 0
