"""TLS at the front door (`--ssl-certfile/--ssl-keyfile`): HTTPS and gRPC over TLS with a self-signed
certificate made by `openssl`; plaintext clients are refused; a half-given pair is a clear error."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from service_procs import ENV, ROOT, router_endpoints, start_router, stop_all

from tandem.default_model import ASSETS_DIR, TARGET_NAME

pytestmark = pytest.mark.slow
MODEL = str(ASSETS_DIR / TARGET_NAME)


@pytest.fixture
def cert(tmp_path):
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return key, crt


def test_https_and_grpc_over_tls(tmp_path, cert):
    key, crt = cert
    router = start_router("router", MODEL, tmp_path, "--ssl-certfile", str(crt), "--ssl-keyfile", str(key))
    try:
        ep = router_endpoints(router)
        assert ep["http"].startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(crt))
        try:
            urllib.request.urlopen(f"{ep['http']}/health", timeout=10, context=trusted)
        except urllib.error.HTTPError as e:  # 503 until a decode worker registers: TLS worked
            assert e.code == 503 and json.loads(e.read())["status"] == "no decode workers"
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted by the client
            urllib.request.urlopen(f"{ep['http']}/health", timeout=10, context=ssl.create_default_context())
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext HTTP on the TLS port
            urllib.request.urlopen(ep["http"].replace("https", "http") + "/health", timeout=10)
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        creds = grpc.ssl_channel_credentials(root_certificates=crt.read_bytes())
        with grpc.secure_channel(ep["grpc"], creds) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no decode worker yet
        with grpc.insecure_channel(ep["grpc"]) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        stop_all([router])


def test_half_a_tls_pair_exits_2(cert):
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "router", "--model", MODEL, "--ssl-certfile",
                          str(cert[1]), "--http-port", "0", "--grpc-port", "0"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "TLS needs both --ssl-certfile and --ssl-keyfile" in out.stderr
