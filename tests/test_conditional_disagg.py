"""Conditional disaggregation (`tandem router --local-prefill-if-busy N`): a prompt of at most N tokens
whose prefill worker already has a prompt in flight is prefilled by its decode worker; longer prompts,
and any prompt while P is idle, still go to P. Real router + P + D processes; P's steps are slowed
(0.6 s each) so that "busy" lasts long enough to be certain. Every answer equals the offline engine's
greedy text, whichever worker computed its prompt."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from service_procs import ENV, ROOT, get_json, metric_value, post, start_serving, stop_all, worker_stats
from tiny_models import make_checkpoint

LIMIT = 40  # --local-prefill-if-busy
LONG = list(range(10, 10 + 2 * LIMIT))  # always P's
SHORT = list(range(300, 300 + LIMIT))  # at the limit: D's while P is busy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("cdisagg") / "ckpt"))


@pytest.fixture(scope="module")
def offline(ckpt):
    from tandem import LLM, SamplingParams

    llm = LLM(ckpt, num_kv_blocks=64)
    outs = llm.generate([LONG, SHORT, SHORT[:-1] + [7], LONG[:-3]],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    procs, ep = start_serving(ckpt, tmp_path_factory.mktemp("cdisagg-serve"), "--local-prefill-if-busy",
                              str(LIMIT), num_kv_blocks=64, prefill_step_delay=0.6)
    try:
        yield ep
    finally:
        stop_all(procs)


def _complete(http: str, prompt: list[int]) -> tuple[str, float]:
    """The greedy text of one completion and when it ended (monotonic)."""
    status, _, body = post(f"{http}/v1/completions", {"model": "ckpt", "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["text"], time.monotonic()


def _counts(http: str) -> tuple[int, int, int]:
    """(prompts P computed, prompts D computed itself, the router's local-when-busy counter)."""
    _, health = get_json(f"{http}/health")
    by_role = {w["role"]: worker_stats(w["address"]) for w in health["workers"]}
    return (by_role["prefill"]["prefills"], by_role["decode"]["local_prefills"],
            int(metric_value(http, "tandem_router_local_prefills_when_busy_total")))


def _while_busy(http: str, first: list[int], second: list[int]) -> tuple[tuple, tuple]:
    """Send `first`, then `second` while P computes `first`; both answers and their end times."""
    results: dict[str, tuple] = {}
    t = threading.Thread(target=lambda: results.update(first=_complete(http, first)))
    t.start()
    time.sleep(0.3)  # the router has dispatched `first` to P, which sleeps 0.6 s per step
    results["second"] = _complete(http, second)
    t.join()
    return results["first"], results["second"]


@pytest.mark.slow
def test_short_prompt_goes_to_d_while_p_is_busy_and_long_ones_wait(served, offline):
    http = served["http"]
    p0, d0, c0 = _counts(http)
    (long_ids, long_end), (short_ids, short_end) = _while_busy(http, LONG, SHORT)
    assert long_ids == offline[0] and short_ids == offline[1]
    assert short_end < long_end  # it did not queue behind P's slow prefill
    assert _counts(http) == (p0 + 1, d0 + 1, c0 + 1)
    # a prompt longer than the limit waits for P even when P is busy
    (a, _), (b, _) = _while_busy(http, LONG, LONG[:-3])
    assert (a, b) == (offline[0], offline[3])
    assert _counts(http) == (p0 + 3, d0 + 1, c0 + 1)


@pytest.mark.slow
def test_a_short_prompt_goes_to_an_idle_p(served, offline):
    http = served["http"]
    p0, d0, c0 = _counts(http)
    ids, _ = _complete(http, SHORT[:-1] + [7])
    assert ids == offline[2]
    assert _counts(http) == (p0 + 1, d0, c0)


def test_a_negative_limit_is_refused_in_one_line():
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "router", "--local-prefill-if-busy", "-1"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "local_prefill_if_busy must be >= 0" in r.stderr, r.stderr


def test_tandem_up_hands_the_limit_to_its_router():
    from tandem.cli import build_parser
    from tandem.cli.up import build_commands

    router, _ = build_commands(build_parser().parse_args(["up", "--local-prefill-if-busy", "512"]), "/m")
    assert router[router.index("--local-prefill-if-busy") + 1] == "512"

    def routed(*flags):
        router, _ = build_commands(build_parser().parse_args(["up", *flags]), "/m")
        return router[router.index("--local-prefill-if-busy") + 1] if "--local-prefill-if-busy" in router else None

    assert routed() == "512"  # on by default for P/D on one box
    assert routed("--local-prefill-if-busy", "0") == "0"  # and off when asked
    assert routed("--colocated") is None  # no P to be busy
