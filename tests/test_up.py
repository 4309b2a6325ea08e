"""`tandem up` as a real process tree on loopback (ephemeral ports, a tiny checkpoint): what it
serves equals the offline engine's greedy output (openai client, gRPC, `tandem chat`, the example
clients), and it leaves no process behind — on SIGTERM, when a child dies, and when `tandem up`
itself is SIGKILLed (the children's tether).

Each `tandem up` gets its own copy of the checkpoint, so "its processes" are exactly those whose
command line holds that copy's unique path (found by scanning /proc).
"""

from __future__ import annotations

import io
import json
import os
import re
import runpy
import shutil
import signal
import sys
import time
from pathlib import Path

import openai
import pytest
from service_procs import ROOT, Proc, grpc_stub, worker_stats
from tiny_models import make_checkpoint

pytestmark = pytest.mark.slow  # real processes / models: deselected by -m 'not slow'

MAX_TOKENS = 12
ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "512"]


def pids_with(marker: str) -> list[int]:
    """Live processes whose command line contains `marker` (zombies have an empty cmdline)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # after "(comm)": state, ppid, ...
            if int(ppid) == pid and state != "Z":
                found.append(int(entry.name))
    return found


def wait_gone(marker: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (left := pids_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


def start_up(tmp: Path, name: str, *flags: str) -> tuple[Proc, dict, str]:
    ckpt = str(tmp / f"ckpt-{name}")
    shutil.copytree(tmp / "ckpt", ckpt)
    proc = Proc(name, [sys.executable, "-m", "tandem.cli", "up", "--model", ckpt, "--http-port", "0",
                       "--grpc-port", "0", *ENGINE, *flags], tmp)
    return proc, json.loads(proc.wait_for(r"tandem-up-ready (\{.*\})", timeout=120).group(1)), ckpt


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("up")
    make_checkpoint(str(tmp / "ckpt"))
    return tmp


@pytest.fixture(scope="module")
def up(tmp):
    # --local-prefill-threshold 0: every prompt takes the disaggregated path through prefill-0.
    proc, ready, ckpt = start_up(tmp, "up", "--prefill", "1", "--decode", "1", "--local-prefill-threshold", "0")
    yield {"proc": proc, "ckpt": ckpt, **ready}
    proc.stop()


@pytest.fixture(scope="module")
def llm(tmp):
    from tandem import LLM

    return LLM(str(tmp / "ckpt"), num_kv_blocks=256, max_model_len=512)


def greedy():
    from tandem import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_openai_chat_stream_equals_offline(up, llm):
    client = openai.OpenAI(base_url=f"{up['http']}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    stream = client.chat.completions.create(model=up["model"], messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == \
        llm.chat(messages, greedy())[0].text
    assert set(up["workers"]) == {"prefill-0", "decode-0"}
    assert worker_stats(up["workers"]["prefill-0"]["control"])["prefills"] >= 1  # P computed it


def test_short_prompts_through_the_prefill_worker_equal_offline(up, llm):
    """Prompts of 1-8 tokens run as decode rows (tandem/engine/decode_group.py), on P too, where the layer
    hook pushes each layer's KV: D continues from it exactly."""
    client = openai.OpenAI(base_url=f"{up['http']}/v1", api_key="none", max_retries=0)
    before = worker_stats(up["workers"]["prefill-0"]["control"])["prefills"]
    for prompt in ([9], [5, 6, 7], list(range(20, 28))):
        out = client.completions.create(model=up["model"], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == llm.generate([prompt], greedy())[0].outputs[0].text, prompt
    assert worker_stats(up["workers"]["prefill-0"]["control"])["prefills"] == before + 3  # P computed them


def test_grpc_generate_stream_equals_offline(up, llm):
    from tandem.protocol import generation_pb2 as pb

    prompt = "class Foo:\n    def"
    responses = list(grpc_stub(up["grpc"]).Generate(
        pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)),
        timeout=60))
    expected = llm.generate([prompt], greedy())[0]
    assert [t for r in responses for t in r.token_ids] == expected.token_ids
    assert "".join(r.text for r in responses) == expected.text and responses[-1].finished


def test_chat_cli_keeps_history(up, llm, monkeypatch, capsys):
    from tandem.cli import main

    turns = ["import os", "def main():"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(turns) + "\n"))  # piped: one line = one turn
    assert main(["chat", "--url", up["grpc"], "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]) == 0
    first = llm.chat([{"role": "user", "content": turns[0]}], greedy())[0].text
    second = llm.chat([{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first},
                       {"role": "user", "content": turns[1]}], greedy())[0].text
    assert capsys.readouterr().out == f"{first}\n{second}\n"


@pytest.mark.parametrize("example,flag", [("grpc_client.py", "grpc"), ("openai_client.py", "http")])
def test_examples_run_against_up(up, example, flag, monkeypatch, capsys):
    # run as `python examples/X --url ...` would, in this process (it has torch imported already)
    monkeypatch.setattr(sys, "argv", [example, "--url", up[flag], "--max-tokens", "8"])
    runpy.run_path(str(ROOT / "examples" / example), run_name="__main__")
    assert "[length, 8 tokens]" in capsys.readouterr().out


def test_sigterm_stops_every_process(up):
    proc = up["proc"]
    assert len(children_of(proc.popen.pid)) == 3 and len(pids_with(up["ckpt"])) == 4  # router, P, D + up
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0
    assert not children_of(proc.popen.pid)
    wait_gone(up["ckpt"], timeout=1)  # `tandem up` waited for them: nothing is left even briefly


def _pid_of(parent: int, role: str) -> int:
    return next(p for p in children_of(parent)
                if f" {role} ".encode() in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" "))


def test_dead_worker_is_restarted_and_a_dead_router_stops_everything(tmp, llm):
    proc, ready, ckpt = start_up(tmp, "colocated", "--colocated", "--decode", "1")
    try:
        assert set(ready["workers"]) == {"decode-0"}
        client = openai.OpenAI(base_url=f"{ready['http']}/v1", api_key="none", max_retries=0)
        want = llm.generate(["import sys\n"], greedy())[0].text

        def ask() -> str:
            return client.completions.create(model=ready["model"], prompt="import sys\n", max_tokens=MAX_TOKENS,
                                             temperature=0).choices[0].text

        assert ask() == want
        first = _pid_of(proc.popen.pid, "decode")
        os.kill(first, signal.SIGKILL)
        proc.wait_for(r"decode-0 exited \(exit code -9\).*\n(.*\n)*.*restarting decode-0 in 1s", timeout=30)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the router serves again once the new worker registered
            try:
                if ask() == want:
                    break
            except openai.APIError:
                time.sleep(0.5)
        else:
            raise AssertionError("the restarted decode worker never served")
        assert proc.popen.poll() is None and _pid_of(proc.popen.pid, "decode") != first
        os.kill(_pid_of(proc.popen.pid, "router"), signal.SIGKILL)  # the front door: nothing to serve with
        assert proc.popen.wait(30) == 1
        assert "router exited unexpectedly (exit code -9)" in proc.log.read_text()
        wait_gone(ckpt, timeout=1)
    finally:
        proc.stop()


def test_sigkill_of_the_parent_takes_its_children_along(tmp):
    """No prctl: a child sees its stdin pipe close when its parent dies, even by SIGKILL, and stops
    itself. A parent that starts one tethered router, as `tandem up` does, is enough to show it."""
    ckpt = str(tmp / "ckpt-killed")
    shutil.copytree(tmp / "ckpt", ckpt)
    script = ("import sys, time\nfrom tandem.cli.supervise import Supervisor\nfrom tandem.cli.up import tethered\n"
              "sup = Supervisor()\nsup.router_endpoints(sup.start('router', tethered(sys.argv[1:])), 60)\n"
              "print('parent-ready', flush=True)\ntime.sleep(600)\n")
    proc = Proc("killed", [sys.executable, "-c", script, "router", "--model", ckpt, "--http-port", "0",
                           "--grpc-port", "0", "--listen", "tcp://127.0.0.1:0"], tmp)
    try:
        proc.wait_for("parent-ready", timeout=60)
        assert len(pids_with(ckpt)) == 2  # the parent and its router
        proc.popen.kill()
        proc.popen.wait()
        wait_gone(ckpt, timeout=20)
    finally:
        for pid in pids_with(ckpt):
            os.kill(pid, signal.SIGKILL)


def test_bad_flags_exit_2(tmp, capsys):
    from tandem.cli import main

    assert main(["up", "--model", str(tmp / "ckpt"), "--colocated", "--prefill", "2"]) == 2
    assert "--colocated runs no prefill workers" in capsys.readouterr().err
    assert main(["up", "--model", str(tmp / "nowhere")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_up_sizes_the_routers_admission_limit_from_the_decode_workers():
    from tandem.cli import build_parser
    from tandem.cli.up import build_commands

    def inflight(*argv: str) -> int:
        router, _ = build_commands(build_parser().parse_args(["up", *argv]), "/m")
        return int(router[router.index("--max-inflight") + 1])

    assert inflight() == 2 * 128  # one decode worker of the default max_num_seqs
    assert inflight("--decode", "3", "--max-num-seqs", "32") == 2 * 3 * 32
    assert inflight("--max-inflight", "10") == 10


def test_engine_flags_show_their_defaults_in_help():
    text = " ".join(_help_of("up").split())
    assert "most requests in one continuous batch (default: 128)" in text
    assert "--block-size BLOCK_SIZE (default: 16)" in text
    assert "memory for the KV cache in GiB (default: 1.0)" in text


def _help_of(command: str) -> str:
    import contextlib
    import io

    from tandem.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        build_parser().parse_args([command, "--help"])
    return out.getvalue()


def test_up_passes_the_parsers_to_the_router_and_refuses_unknown_ones(capsys):
    from tandem.cli import build_parser
    from tandem.cli.up import build_commands

    router, _ = build_commands(build_parser().parse_args(["up", "--tool-call-parser", "hermes",
                                                          "--reasoning-parser", "qwen3"]), "/m")
    assert router[router.index("--tool-call-parser") + 1] == "hermes"
    assert router[router.index("--reasoning-parser") + 1] == "qwen3"
    assert "--tool-call-parser" not in build_commands(build_parser().parse_args(["up"]), "/m")[0]
    for command in ("up", "router"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([command, "--tool-call-parser", "xlam"])
        assert exit_.value.code == 2 and "--tool-call-parser" in capsys.readouterr().err
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([command, "--reasoning-parser", "granite"])
        assert exit_.value.code == 2 and "--reasoning-parser" in capsys.readouterr().err


def test_log_level_reaches_the_router_and_every_worker(tmp, llm):
    """`tandem up --log-level warning`: the children log no info lines (the per-request line included)
    while serving; the default `up` above logs them (its relayed output has them)."""
    proc, ready, _ = start_up(tmp, "quiet-logs", "--colocated", "--log-level", "warning")
    try:
        client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="x")
        out = client.completions.create(model=client.models.list().data[0].id, prompt=[5, 6, 7], max_tokens=4,
                                        temperature=0)
        from tandem import SamplingParams

        offline = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
        assert out.choices[0].text == offline
    finally:
        proc.stop()
    relayed = proc.log.read_text()
    assert "[router]" in relayed and "[decode-0]" in relayed  # the children's own lines are relayed ...
    assert not re.search(r"\[(router|decode-0)\].*(\"level\": \"info\"|\[info)", relayed), relayed[-2000:]
    assert "request finished" not in relayed  # ... but none at info
