"""tandem.engine.thread_backoff: the engine gives up threads while its threads wait for a CPU, probes
to take them back with growing gaps, and keeps them when the wait is gone; the wait it reads is the
kernel's real run-queue wait."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tandem.engine import thread_backoff as tb


class Fake:
    """A clock and a run-queue wait counter the test moves by hand."""

    def __init__(self) -> None:
        self.now, self.wait = 100.0, 0.0

    def advance(self, seconds: float, waited_share: float) -> None:
        self.now += seconds
        self.wait += seconds * waited_share


@pytest.fixture
def thread_calls(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(tb.torch, "set_num_threads", calls.append)
    return calls


def make(fake: Fake, threads: int = 4) -> tb.ThreadBackoff:
    return tb.ThreadBackoff(threads, clock=lambda: fake.now, wait_s=lambda: fake.wait)


def run_for(backoff: tb.ThreadBackoff, fake: Fake, seconds: float, share: float) -> None:
    """Steps of 50 ms for `seconds`, each with `share` of the wall time spent waiting for a CPU."""
    for _ in range(round(seconds / 0.05)):
        fake.advance(0.05, share)
        backoff.tick()


def test_idle_machine_keeps_every_thread(thread_calls):
    fake = Fake()
    b = make(fake)
    run_for(b, fake, 30, 0.05)
    assert b.enabled and b.threads == 4 and thread_calls == []


def test_backs_off_by_the_cores_taken_probes_with_growing_gaps_and_recovers(thread_calls):
    fake = Fake()
    b = make(fake)
    run_for(b, fake, 1.0, 2.2)  # two cores' worth of waiting: two threads given back
    assert thread_calls == [2] and b.threads == 2
    run_for(b, fake, tb.FIRST_PROBE_S - 1.0, 0.0)  # backed off, nobody waits: no probe yet
    assert thread_calls == [2]
    run_for(b, fake, 2.0, 1.5)  # the probe (4 threads) finds the neighbour still there
    assert thread_calls == [2, 4, 2] and b.probe_every == 2 * tb.FIRST_PROBE_S
    run_for(b, fake, 2 * tb.FIRST_PROBE_S - 2.0, 0.0)  # the next probe waits twice as long
    assert thread_calls == [2, 4, 2]
    run_for(b, fake, 3.0, 0.0)  # the neighbour is gone: the probe keeps all four
    assert thread_calls == [2, 4, 2, 4] and b.threads == 4 and b.probe_every == tb.FIRST_PROBE_S
    run_for(b, fake, 20, 0.0)
    assert thread_calls == [2, 4, 2, 4]


def test_probe_gap_is_capped(thread_calls):
    fake = Fake()
    b = make(fake, threads=2)
    run_for(b, fake, 600, 0.9)  # a neighbour that never leaves
    assert set(thread_calls) == {1, 2} and b.probe_every == tb.LAST_PROBE_S
    probes = thread_calls.count(2)
    assert 9 <= probes <= 20  # 5 + 10 + 20 + 40 + 60 * k s: a probe costs ~1% of the time, not more


def test_off_for_one_thread_and_by_environment(thread_calls, monkeypatch):
    fake = Fake()
    assert not make(fake, threads=1).enabled
    monkeypatch.setenv("TANDEM_THREAD_BACKOFF", "0")
    b = make(fake)
    run_for(b, fake, 5, 3.0)
    assert not b.enabled and thread_calls == []
    assert not tb.ThreadBackoff(4, wait_s=lambda: None).enabled  # no /proc: nothing to read


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")
def test_the_wait_read_is_the_kernels_run_queue_wait():
    """A busy thread pinned to one core with a busy process on the same core waits for it about half of
    the time; alone on its core, clearly less (hardly at all on an idle machine; the test suite's other workers
    may share the core). Read through the same function the engine uses."""
    core = sorted(os.sched_getaffinity(0))[0]
    before_mask = os.sched_getaffinity(0)

    def busy_share(seconds: float) -> float:
        w0, t0 = tb._run_queue_wait_s(), time.monotonic()
        while time.monotonic() - t0 < seconds:
            pass
        return (tb._run_queue_wait_s() - w0) / (time.monotonic() - t0)

    os.sched_setaffinity(0, {core})
    try:
        # "alone" may share the core with another test worker's processes: the quietest of three reads
        alone = min(busy_share(0.3) for _ in range(3))
        spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                                    "while True: pass"])
        try:
            time.sleep(0.3)
            shared = busy_share(1.0)
        finally:
            spinner.kill()
            spinner.wait()
    finally:
        os.sched_setaffinity(0, before_mask)
    assert shared > tb.WAIT_SHARE, shared
    assert shared > alone + 0.1, (alone, shared)  # the spinner's share shows, whatever else runs there
