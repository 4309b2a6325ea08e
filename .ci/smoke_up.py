"""CI smoke test of the README's first command, as a new user runs it: `tandem up` on the built-in model.

Runs with nothing but what `pip install -e .` installs (no numpy, no transformers, no openai):
1. start `tandem up` in the background (free ports) and wait for its ready line;
2. send one prompt longer than the decode worker's local-prefill threshold, so its KV really comes
   from the prefill worker, through the OpenAI HTTP API (non-streamed and streamed) and gRPC;
3. check that the three greedy answers are identical to each other and to the offline engine
   (`tandem.LLM`) on the same model, and that the decode worker counted a remote prefill;
4. stop `tandem up` with SIGINT and require exit code 0 and no process left behind.
Exits non-zero, with tandem up's output, on any failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

BODY = ('"""Utilities for reading configuration files.\n\nThe parser accepts a path and returns a dict of '
          'sections, each a dict of keys and values, with defaults applied.\n"""\n\nimport os\nimport sys\n\n\n'
          'def read_config(path, defaults=None):\n    """Return the parsed configuration at path."""\n')
# One prompt per front door, each with its own first line: a shared prefix would be found in the decode
# worker's prefix cache, leaving too few uncached tokens to go to the prefill worker.
PROMPTS = {door: f"# {door}\n{BODY}" for door in ("http", "http-stream", "grpc")}
MAX_TOKENS = 24
MIN_PROMPT_TOKENS = 64  # twice the default --local-prefill-threshold (32)


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def http_answers(http: str, model: str) -> tuple[str, str, int]:
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    plain = json.loads(post(f"{http}/v1/completions", {**body, "prompt": PROMPTS["http"]}))
    streamed = ""
    raw = post(f"{http}/v1/completions", {**body, "prompt": PROMPTS["http-stream"], "stream": True})
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert plain["usage"]["completion_tokens"] == MAX_TOKENS, plain["usage"]
    return plain["choices"][0]["text"], streamed, plain["usage"]["prompt_tokens"]


def grpc_answer(target: str) -> str:
    import grpc

    from tandem.protocol import generation_pb2 as pb
    from tandem.protocol import generation_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return "".join(r.text for r in stub.Generate(pb.GenerateRequest(text=PROMPTS["grpc"], sampling=sampling),
                                                      timeout=120))


def offline_answers() -> dict[str, str]:
    from tandem import LLM, SamplingParams

    llm = LLM()  # with the checkpoint's generation_config defaults, as the server applies them
    outs = llm.generate(list(PROMPTS.values()), SamplingParams(**{**llm.sampling_defaults, "temperature": 0,
                                                                  "max_tokens": MAX_TOKENS, "ignore_eos": True}))
    return {door: out.text for door, out in zip(PROMPTS, outs)}


def remote_prefills(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'^tandem_decode_prefills_total\{[^}]*where="remote"[^}]*\} (\S+)', text, re.MULTILINE)
    return sum(float(v) for v in found)


def main() -> int:
    log = tempfile.NamedTemporaryFile("w+", prefix="tandem-up-", suffix=".log", delete=False)
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--http-port", "0", "--grpc-port", "0"],
                          stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        ready = None
        deadline = time.monotonic() + 300
        while ready is None and time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                raise RuntimeError(f"tandem up exited ({up.wait()}) before it was ready")
            print(line, end="", flush=True)
            if line.startswith("tandem-up-ready "):
                ready = json.loads(line.split(" ", 1)[1])
        if ready is None:
            raise RuntimeError("tandem up was not ready within 300 s")
        plain, streamed, n_prompt = http_answers(ready["http"], ready["model"])
        via_grpc = grpc_answer(ready["grpc"])
        served = {"http": plain, "http-stream": streamed, "grpc": via_grpc}
        offline = offline_answers()
        print(f"prompts of {n_prompt} tokens; served {served}")
        assert n_prompt >= MIN_PROMPT_TOKENS, f"the prompt has only {n_prompt} tokens"
        assert served == offline and all(served.values()), f"served {served}\noffline {offline}"
        decode_metrics = [w["metrics"] for n, w in ready["workers"].items() if n.startswith("decode")]
        assert remote_prefills(decode_metrics[0]) >= 3, "the prompts were not prefilled by the prefill worker"
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=60)
        assert code == 0, f"tandem up exited {code} on SIGINT"
        left = subprocess.run(["pgrep", "-f", "tandem.cli.up (router|prefill|decode)"], capture_output=True, text=True)
        assert not left.stdout.strip(), f"processes left behind: {left.stdout}"
        print("smoke test passed: HTTP, HTTP stream and gRPC answers equal the offline engine's; "
              "tandem up stopped cleanly")
        return 0
    except Exception as exc:
        log.seek(0)
        print(f"smoke test FAILED: {exc!r}\n--- tandem up output ---\n{log.read()[-20000:]}", file=sys.stderr)
        return 1
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        os.unlink(log.name)


if __name__ == "__main__":
    sys.exit(main())
