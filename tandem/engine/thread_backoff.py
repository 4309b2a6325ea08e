"""ThreadBackoff: an engine that shares its cores with a busy neighbour gives up threads instead of
spinning against it, and takes them back when the neighbour goes.

Why: torch's OpenMP threads meet at a barrier after every op, and libgomp spin-waits there. When
another process takes a core, the thread that loses it is descheduled and the others spin at every
barrier until it runs again: with one `while True: pass` beside it, a two-thread engine lost ~70% of
its throughput on the 2-core benchmark machine while one thread lost ~10% (docs/PERFORMANCE.md,
"Offline throughput beside a CPU-hungry neighbour"). vLLM's CPU build avoids this by binding its
threads and reserving a core; tandem keeps every core when the machine is its own and backs off when
it is not.

The signal is the kernel's own: /proc/self/task/*/schedstat gives each thread's time spent runnable
but waiting for a CPU. Every INTERVAL_S of engine steps, if this process's threads waited more than
WAIT_SHARE of the wall time (an idle machine: ~0; one core taken: ~0.5 or more), the engine drops to
fewer threads (one per core it still has, at least one). While backed off it probes: for one interval
it runs with all its threads again, and keeps them if the wait stays low; probes come after 5, 10, 20
... up to 60 s, so a neighbour that stays costs at most a few percent. Only engines with more than one
thread on Linux do any of this; `TANDEM_THREAD_BACKOFF=0` turns it off (for A/B runs).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

INTERVAL_S = 0.5  # how often the wait is read (a step is 2-100 ms: many steps per reading)
WAIT_SHARE = 0.25  # summed run-queue wait / wall time above which the cores are contended
FIRST_PROBE_S, LAST_PROBE_S = 5.0, 60.0


def _run_queue_wait_s() -> float | None:
    """Seconds this process's threads have spent runnable but not running (None: not available)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended between the listing and the read
    return total / 1e9


class ThreadBackoff:
    """Call `tick()` once per engine step; it changes torch's thread count when the readings say so."""

    def __init__(self, threads: int | None = None, clock=time.monotonic, wait_s=_run_queue_wait_s) -> None:
        self.full = threads if threads is not None else torch.get_num_threads()
        self.clock, self.wait_s = clock, wait_s
        self.enabled = (self.full > 1 and os.environ.get("TANDEM_THREAD_BACKOFF", "1") != "0"
                        and wait_s() is not None)
        self.threads = self.full
        self.probing = False
        self.probe_every = FIRST_PROBE_S
        self.changes = 0
        now = clock()
        self._mark = (now, wait_s() or 0.0) if self.enabled else (now, 0.0)
        self._next_probe = 0.0

    def tick(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        t0, w0 = self._mark
        if now - t0 < INTERVAL_S:
            return
        w = self.wait_s() or 0.0
        self._mark = (now, w)
        share = (w - w0) / (now - t0)
        if self.threads == self.full and not self.probing:
            if share > WAIT_SHARE:  # a neighbour has a core: give back as many as it took, at least one
                self._set(max(1, self.full - max(1, round(share))), now, share, "cpu contended")
        elif self.probing:  # one interval at full threads: keep them if nobody made them wait
            self.probing = False
            if share > WAIT_SHARE:
                self.probe_every = min(LAST_PROBE_S, self.probe_every * 2)
                self._set(self._backed_off, now, share, "still contended")
            else:
                self.probe_every = FIRST_PROBE_S
                log.info("thread backoff ended", threads=self.full, run_queue_wait_share=round(share, 2))
        elif now >= self._next_probe:
            self.probing, self._backed_off = True, self.threads
            torch.set_num_threads(self.full)
            self.threads = self.full
            self._mark = (self.clock(), self.wait_s() or 0.0)

    def _set(self, threads: int, now: float, share: float, why: str) -> None:
        log.info("thread backoff", reason=why, threads=threads, of=self.full, run_queue_wait_share=round(share, 2),
                 next_probe_s=self.probe_every)
        torch.set_num_threads(threads)
        self.threads, self.changes = threads, self.changes + 1
        self._next_probe = now + self.probe_every
        self._mark = (self.clock(), self.wait_s() or 0.0)
