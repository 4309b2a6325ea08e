"""The front door with an API key (`tandem router --api-key`, or $TANDEM_API_KEY): the OpenAI API and
gRPC Generate refuse a missing or wrong key; health and metrics stay open for probes and scrapers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from service_procs import get_json, grpc_stub, router_endpoints, start_router, stop_all

from tandem.default_model import ASSETS_DIR, TARGET_NAME

pytestmark = pytest.mark.slow
KEY = "s3cret-key"


def post_with(http: str, headers: dict[str, str]) -> int:
    body = json.dumps({"model": "tiny-target", "prompt": "x", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{http}/v1/completions", body, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_api_key_guards_the_api_but_not_the_probes(tmp_path):
    router = start_router("router", str(ASSETS_DIR / TARGET_NAME), tmp_path, "--api-key", KEY)
    try:
        ep = router_endpoints(router)
        assert post_with(ep["http"], {}) == 401
        assert post_with(ep["http"], {"Authorization": "Bearer wrong"}) == 401
        assert post_with(ep["http"], {"Authorization": f"Bearer {KEY}"}) == 503  # past the key: no workers yet
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{ep['http']}/v1", api_key="wrong", max_retries=0).models.list()
        models = openai.OpenAI(base_url=f"{ep['http']}/v1", api_key=KEY, max_retries=0).models.list()
        assert [m.id for m in models.data] == [TARGET_NAME]
        assert get_json(f"{ep['http']}/health")[0] == 503  # open, and honest: no decode worker
        for headers, status in (({}, 401), ({"Authorization": f"Bearer {KEY}"}, 200)):  # /tokenize: the router alone
            req = urllib.request.Request(f"{ep['http']}/tokenize", json.dumps({"prompt": "x"}).encode(), headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    assert r.status == status and json.loads(r.read())["count"] >= 1
            except urllib.error.HTTPError as e:
                assert e.code == status
        with urllib.request.urlopen(f"{ep['http']}/metrics", timeout=10) as r:
            assert r.status == 200  # open by default: scrapers; --protect-metrics guards it (below)
        from tandem.protocol import generation_pb2 as pb

        request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=2))
        stub = grpc_stub(ep["grpc"])
        for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", f"Bearer {KEY}"),), grpc.StatusCode.UNAVAILABLE)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=metadata, timeout=10))
            assert err.value.code() == code, (metadata, err.value)
    finally:
        stop_all([router])


def test_protect_metrics_puts_metrics_behind_the_key(tmp_path):
    router = start_router("router", str(ASSETS_DIR / TARGET_NAME), tmp_path, "--api-key", KEY, "--protect-metrics")
    try:
        http = router_endpoints(router)["http"]
        for headers, status in (({}, 401), ({"Authorization": f"Bearer {KEY}"}, 200)):
            req = urllib.request.Request(f"{http}/metrics", headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    assert (r.status, b"tandem_router" in r.read()) == (status, True)
            except urllib.error.HTTPError as e:
                assert e.code == status
        assert get_json(f"{http}/health")[0] == 503  # probes stay open
    finally:
        stop_all([router])
