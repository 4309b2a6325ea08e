"""The container image and the compose deployment, for real: scripts/build_image.sh builds (or reuses,
layers cached) the image; `tandem up` inside it serves the same greedy completion as the in-process
engine on the built-in model; every process in it runs as uid 1000, numpy imports and no compiler is
installed; deploy/smoke_compose.sh brings up router + prefill + decode and serves requests.

Run: python -m pytest -q -m slow tests/test_container.py
Without a container engine (CI's machines have none) or where the image cannot be built (no base
image and no debootstrap/root, no network to PyPI) every test skips at once, saying what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest
from service_procs import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a first build debootstraps and installs torch

IMAGE = os.environ.get("TANDEM_IMAGE", "tandem:latest")
PROMPT, MAX_TOKENS = "def fibonacci(n):", 12
ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "512"]


def _engine() -> str | None:
    """podman, else docker whose daemon answers (a docker client alone, as on CI, is no engine)."""
    for name in ("podman", "docker"):
        path = shutil.which(name)
        if path and subprocess.run([path, "info"], capture_output=True, timeout=30).returncode == 0:
            return path
    return None


def _pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def engine() -> str:
    found = _engine()
    if found is None:
        pytest.skip("no container engine: neither `podman info` nor `docker info` answers (see deploy/README.md)")
    return found


@pytest.fixture(scope="module")
def image(engine) -> str:
    start = time.monotonic()
    out = subprocess.run([str(ROOT / "scripts" / "build_image.sh")], capture_output=True, text=True,
                         env={**os.environ, "TANDEM_ENGINE": os.path.basename(engine), "TANDEM_IMAGE": IMAGE})
    if out.returncode == 3:  # the script's "a prerequisite is missing"
        pytest.skip(f"cannot build the image: {out.stderr.strip().splitlines()[-1]}")
    if out.returncode != 0 and not _pypi_reachable():
        pytest.skip("cannot build the image: PyPI is unreachable")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    size = int(out.stdout.split()[-1])
    print(f"\nimage {IMAGE}: {size / 1e6:.0f} MB, build_image.sh took {time.monotonic() - start:.0f} s")
    return IMAGE


def _run(engine: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([engine, *args], capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(engine, image):
    """`tandem up` (1 prefill + 1 decode) in one container, its HTTP port published on loopback."""
    name, port = f"tandem-test-{uuid.uuid4().hex[:8]}", _free_port()
    out = _run(engine, "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", image,
               "up", "--host", "0.0.0.0", "--local-prefill-threshold", "0", *ENGINE)
    assert out.returncode == 0, out.stderr
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if json.loads(r.read())["live_workers"] == {"prefill": 1, "decode": 1}:
                        break
            except (OSError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                pytest.fail("tandem up in the container never became healthy:\n" + _run(engine, "logs", name).stderr)
            time.sleep(0.5)
        yield {"name": name, "url": f"http://127.0.0.1:{port}"}
    finally:
        _run(engine, "stop", "-t", "40", name, timeout=90)  # SIGTERM: tandem up stops its children
        _run(engine, "rm", "-f", name)


def test_up_in_the_image_serves_the_offline_engines_greedy_completion(served):
    from tandem import LLM, SamplingParams
    from tandem.default_model import default_model_path

    body = {"model": "tiny-target", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    req = urllib.request.Request(f"{served['url']}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        got = json.loads(r.read())["choices"][0]["text"]
    llm = LLM(default_model_path(), num_kv_blocks=256, max_model_len=512)
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].text
    assert got == want and got


def test_the_image_runs_as_uid_1000_with_numpy_and_no_compiler(engine, image, served):
    # every process of the running `tandem up` (router, workers) and the exec'd probe itself
    out = _run(engine, "exec", served["name"], "python", "-c",
               "import os; print(sorted({os.stat(f'/proc/{p}').st_uid for p in os.listdir('/proc') if p.isdigit()}))")
    assert out.returncode == 0 and out.stdout.strip() == "[1000]", out.stdout + out.stderr
    # numpy imports, so torch does not warn (the warning tandem otherwise filters) at every start
    out = _run(engine, "run", "--rm", "--entrypoint", "python", image, "-c",
               "import numpy, torch; print(numpy.__version__, torch.__version__, torch.tensor([1.5]).numpy())")
    assert out.returncode == 0 and "+cpu" in out.stdout and "NumPy" not in out.stderr, out.stdout + out.stderr
    out = _run(engine, "run", "--rm", "--entrypoint", "sh", image, "-c", "command -v gcc cc c++ make || echo none")
    assert out.stdout.strip() == "none", out.stdout


def test_compose_smoke_script_serves(engine, image):
    compose = None
    if os.path.basename(engine) == "podman":
        compose = shutil.which("podman-compose")
    elif subprocess.run([engine, "compose", "version"], capture_output=True).returncode == 0:
        compose = f"{engine} compose"
    if compose is None:
        pytest.skip(f"no compose tool for {os.path.basename(engine)} (podman-compose or the docker compose plugin)")
    out = subprocess.run([str(ROOT / "deploy" / "smoke_compose.sh")], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TANDEM_IMAGE": image, "TANDEM_COMPOSE": compose})
    print(out.stderr[-2000:])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads(re.search(r"^smoke-compose-result (\{.*\})$", out.stdout, re.M).group(1))
    assert result["live_workers"] == {"prefill": 1, "decode": 1} and result["prefills"] >= 4
    assert result["completion"].strip() and result["chat"].strip()
    leftovers = _run(engine, "ps", "-a", "-q", "--filter", "label=com.docker.compose.project=tandem-smoke")
    assert leftovers.stdout.strip() == "", "the smoke script left containers behind"
