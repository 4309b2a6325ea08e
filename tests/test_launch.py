"""`tandem launch` and the deploy/ files: the exact commands `--dry-run` prints for
deploy/cluster.example.yaml, clear errors (exit 2) naming a bad key, an all-localhost cluster as
real processes that serves a request and stops cleanly on SIGTERM, and docker-compose.yml's
commands parsed as `tandem` invocations (plus `docker compose config` / `docker-compose config` where
installed).
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import yaml
from service_procs import ENV, ROOT, Proc, post
from test_up import pids_with, wait_gone
from tiny_models import make_checkpoint

EXAMPLE = ROOT / "deploy" / "cluster.example.yaml"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"


def dry_run(path, capsys) -> list[tuple[str, list[str]]]:
    from tandem.cli import main

    assert main(["launch", str(path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [(lines[i].removeprefix("# "), shlex.split(lines[i + 1])) for i in range(0, len(lines), 2)]


def test_dry_run_prints_the_exact_commands(capsys):
    procs = dry_run(EXAMPLE, capsys)
    assert [name for name, _ in procs] == ["router on 10.0.0.1", "10.0.0.2-prefill-0 on 10.0.0.2",
                                           "10.0.0.2-prefill-1 on 10.0.0.2", "10.0.0.3-decode-0 on 10.0.0.3",
                                           "10.0.0.3-decode-1 on 10.0.0.3"]
    ssh = ["ssh", "-T", "-o", "BatchMode=yes", "-p", "22", "-o", "StrictHostKeyChecking=accept-new"]
    python = ["/opt/tandem/venv/bin/python", "-m", "tandem.cli.up"]
    model, engine = ["--model", "/models/Llama-3.1-8B-Instruct"], ["--dtype", "bfloat16", "--kv-cache-memory-gb", "40"]
    keys = ["--link-keys", "/etc/tandem/keys"]
    for (_, argv), target in zip(procs, ["tandem@10.0.0.1"] + ["tandem@10.0.0.2"] * 2 + ["ubuntu@10.0.0.3"] * 2):
        assert argv[:-1] == [*ssh, target] and shlex.split(argv[-1])[0] == "exec"
    remote = [shlex.split(argv[-1])[1:] for _, argv in procs]
    assert remote[0] == [*python, "router", *model, "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port",
                         "50051", "--listen", "tcp://0.0.0.0:5557", "--decode-policy", "least_loaded", *keys]
    for i in range(2):
        assert remote[1 + i] == ["env", f"CUDA_VISIBLE_DEVICES={i}", *python, "prefill", *model, "--kv-connector",
                                 "zmq", "--listen", f"tcp://10.0.0.2:{6000 + i}", "--router", "tcp://10.0.0.1:5557",
                                 "--worker-id", f"10.0.0.2-prefill-{i}", "--cpus", f"{i}/2", *keys, *engine]
        assert remote[3 + i] == ["env", f"CUDA_VISIBLE_DEVICES={i}", *python, "decode", "--model",
                                 "/data/models/Llama-3.1-8B-Instruct", "--kv-connector", "zmq", "--listen",
                                 f"tcp://10.0.0.3:{6100 + i}", "--router", "tcp://10.0.0.1:5557", "--worker-id",
                                 f"10.0.0.3-decode-{i}", "--cpus", f"{i}/2", "--kv-listen",
                                 f"tcp://10.0.0.3:{6200 + i}", *keys, *engine,
                                 "--local-prefill-threshold", "16"]


BAD = [  # (YAML, what the one-line error must say)
    ("router: {host: localhost}\nhosts: [{host: localhost, decode: {count: 1}}]\nkv_conector: zmq\n",
     "kv_conector: unknown key"),
    ("router: {host: localhost}\nhosts: [{host: localhost, decode: {count: 1, cont: 2}}]\n",
     "hosts[0].decode.cont: unknown key (expected one of: count, port, kv_port, cpus, args, env)"),
    ("router: {host: localhost, htp_port: 1}\nhosts: [{host: localhost, decode: {count: 1}}]\n",
     "router.htp_port: unknown key"),
    ("router: {host: localhost}\nengine: {num_kv_block: 4}\nhosts: [{host: localhost, decode: {count: 1}}]\n",
     "engine.num_kv_block: unknown key"),
    ("router: {host: localhost}\nengine: {num_kv_blocks: lots}\nhosts: [{host: localhost, decode: {count: 1}}]\n",
     "engine.num_kv_blocks: bad value 'lots'"),
    ("router: {host: 10.0.0.1}\nhosts: [{host: 10.0.0.2, decode: {count: 1, port: 0}}]\n",
     "hosts[0].decode.port: expected a port 1..65535, got 0"),
    ("router: {host: 10.0.0.1}\nhosts: [{host: localhost, decode: {count: 1}}]\n",
     "hosts[0].host: 'localhost' cannot be reached from the other hosts"),
    ("router: {host: localhost}\nhosts: [{host: localhost, prefill: {count: 1}, decode: {count: 1}}]\n"
     "kv_connector: nccl\n", "kv_connector: 'nccl' is not one of"),
    ("router: {host: localhost}\nhosts: [{host: localhost, prefill: {count: 101}, decode: {count: 1}}]\n",
     "hosts[0].decode.port (worker 0): port 6100 on localhost is already taken by hosts[0].prefill.port (worker 100)"),
    ("router: {host: localhost}\nkv_connector: none\n"
     "hosts: [{host: localhost, decode: {count: 1, args: [--bogus]}}]\n",
     "hosts[0].decode: the command `tandem decode"),
    ("hosts: []\n", "missing required key 'router'"),
    ("router: {host: 10.0.0.1}\nkv_connector: none\nhosts: [{host: 10.0.0.2, decode: {count: 1}}]\n",
     "link_keys: required when hosts are remote: run `tandem keys DIR`"),
    ("router: {host: localhost}\nkv_connector: none\ninsecure_links: yes please\n"
     "hosts: [{host: localhost, decode: {count: 1}}]\n",
     "insecure_links: expected true or false"),
    ("router: {host: localhost}\nhosts: [{host: localhost, prefill: {count: 1, cpus: 0-1},"
     " decode: {count: 1, cpus: 1-3}}]\n", "hosts[0]: prefill.cpus and decode.cpus overlap on cores 1"),
    ("router: {host: localhost}\nhosts: [{host: localhost, prefill: {count: 1, cpus: '0'}, decode: {count: 1}}]\n",
     "hosts[0].decode.cpus: set cpus for both roles on a host, or for neither"),
    ("router: {host: localhost}\nkv_connector: none\nhosts: [{host: localhost, decode: {count: 1, cpus: '3-1'}}]\n",
     "hosts[0].decode.cpus: cpuset '3-1': the range '3-1' is empty"),
    ("router: {host: localhost}\nkv_connector: none\nhosts: [{host: localhost, decode: {count: 3, cpus: '0-1'}}]\n",
     "hosts[0].decode.cpus: 2 cores for 3 workers"),
    ("router: [oops\n", "is not valid YAML"),
]


@pytest.mark.slow
@pytest.mark.parametrize("text,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_cluster_is_a_clear_error(tmp_path, capsys, text, message):
    from tandem.cli import main

    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    assert main(["launch", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"tandem launch: error: {path}: ") and err.count("\n") == 1, err


def test_bad_key_exits_2_from_the_command_line(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("router: {host: localhost}\nhost: []\n")
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "launch", str(path)], capture_output=True, text=True,
                         env=ENV, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "host: unknown key (expected one of: model, kv_connector" in out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_host_with_both_roles_gets_role_aware_shares(tmp_path, capsys):
    """Without cpus:, each worker's --cpus is its share of the host, "i/n:p" with p = the host's prefill
    workers, so that past the host's core count roles share cores only within themselves (docs/CPUS.md)."""
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent("""\
        model: /models/m
        insecure_links: true
        router: {host: 10.0.0.1}
        hosts:
          - host: 10.0.0.2
            prefill: {count: 1}
            decode: {count: 2}
        """))
    remote = {name.split(" ")[0]: shlex.split(argv[-1]) for name, argv in dry_run(path, capsys)}  # ssh ... 'CMD'
    shares = {name: cmd[cmd.index("--cpus") + 1] for name, cmd in remote.items() if "--cpus" in cmd}
    assert shares == {"10.0.0.2-prefill-0": "0/3:1", "10.0.0.2-decode-0": "1/3:1", "10.0.0.2-decode-1": "2/3:1"}


def test_localhost_cluster_serves_and_stops_cleanly(tmp_path):
    from tandem import LLM, SamplingParams

    ckpt = make_checkpoint(str(tmp_path / "ckpt-launch"))
    http, grpc_port, listen = free_port(), free_port(), free_port()
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: {ckpt}
        kv_connector: zmq
        engine: {{num_kv_blocks: 256, max_model_len: 512}}
        router: {{host: 127.0.0.1, http_port: {http}, grpc_port: {grpc_port}, listen_port: {listen}}}
        hosts:
          - host: localhost
            prefill: {{count: 1, port: 0}}
            decode: {{count: 1, port: 0, args: ["--local-prefill-threshold", "0"]}}
        """))
    proc = Proc("launch", [sys.executable, "-m", "tandem.cli", "launch", str(path), "--quiet"], tmp_path)
    try:
        ready = json.loads(proc.wait_for(r"tandem-up-ready (\{.*\})", timeout=120).group(1))
        assert ready["http"] == f"http://127.0.0.1:{http}" and ready["grpc"] == f"127.0.0.1:{grpc_port}"
        assert set(ready["workers"]) == {"localhost-prefill-0", "localhost-decode-0"}
        status, _, body = post(f"{ready['http']}/v1/completions",
                               {"prompt": "import os\n", "max_tokens": 12, "temperature": 0})
        expected = LLM(ckpt, num_kv_blocks=256, max_model_len=512).generate(
            ["import os\n"], SamplingParams(temperature=0, max_tokens=12))[0].text
        assert status == 200 and body["choices"][0]["text"] == expected
        assert len(pids_with(ckpt)) == 3  # router, prefill, decode
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        wait_gone(ckpt, timeout=1)
    finally:
        proc.stop()


def test_compose_commands_are_tandem_invocations():
    from tandem.cli import build_parser

    compose = yaml.safe_load(COMPOSE.read_text())
    assert set(compose["services"]) >= {"router", "prefill", "decode"}
    roles = {}
    for name, service in compose["services"].items():
        args = build_parser().parse_args(service["command"])  # argparse exits (fails the test) on a bad flag
        roles[name] = args.command
        if args.command in ("prefill", "decode"):
            assert args.router == "tcp://router:5557" and args.kv_connector == "zmq"
            port = args.listen.rsplit(":", 1)[1]
            assert args.listen == f"tcp://0.0.0.0:{port}" and service["environment"]["TANDEM_WORKER_PORT"] == port
    assert roles["router"] == "router" and roles["prefill"] == "prefill" and roles["decode"] == "decode"
    router = build_parser().parse_args(compose["services"]["router"]["command"])
    assert router.listen == "tcp://0.0.0.0:5557" and router.host == "0.0.0.0"
    assert "name" not in compose  # docker-compose 1.29 rejects a top-level `name:`
    for service in ("router", "prefill", "decode"):
        assert compose["services"][service]["restart"] and compose["services"][service]["healthcheck"]["test"]
    # The compose tools validate the file for real where installed: compose v2 (the docker plugin) and
    # v1 (docker-compose 1.29, Debian 12's). The file refuses to load without a link secret.
    env = {**ENV, "TANDEM_LINK_SECRET": "0" * 64}
    docker = shutil.which("docker")
    tools = []
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        tools.append([docker, "compose"])
    if shutil.which("docker-compose"):
        tools.append([shutil.which("docker-compose")])
    for tool in tools:
        out = subprocess.run([*tool, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 0, (tool, out.stderr)
