"""The deployment files, checked offline (no Kubernetes API server, no Docker daemon): the kustomize
base and every overlay under deploy/k8s/ render with `kubectl kustomize` and pass strict schema
validation; the rendered objects agree with tandem's own CLI, ports and metric names; deliberately
broken overlays (tests/fixtures/k8s_broken/) are refused with a message naming the bad field; the
compose files pass the compose-spec schema and everything under deploy/ passes yamllint.

Built-in kinds are validated by kubernetes-validate --strict (its bundled OpenAPI schemas). Custom
resources have no schema there, so the LeaderWorkerSet is checked against LWS_SCHEMA (tests/k8s_render.py: the
fields these manifests use, unknown ones refused) and its pod templates as strict core/v1 PodTemplates.
Any other custom kind fails: nothing renders unvalidated.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from k8s_render import (
    BROKEN,
    K8S,
    OVERLAYS,
    ROLES,
    ROOT,
    expand,
    flag,
    needs_kubectl,
    pod_templates,
    render,
    resolve_port,
    role_of,
    selects,
    tandem_parser,
    validation_errors,
)

# ---- every overlay --------------------------------------------------------------------------------

def test_every_kustomization_under_deploy_k8s_is_tested():
    found = {str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml")
             if yaml.safe_load(p.read_text())["kind"] == "Kustomization"}
    assert found == set(OVERLAYS), "add the new overlay to OVERLAYS (and to docs/DEPLOYMENT.md)"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay):
    objects = render(K8S / overlay)
    assert objects, f"{overlay} rendered nothing"
    assert validation_errors(objects) == []
    # No credential ships in the repository: the link secret is the operator's (kubectl create secret).
    assert not [o for o in objects if o["kind"] == "Secret"], f"{overlay} renders a Secret"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_real_tandem_commands(overlay):
    """Every container's args parse with tandem's own CLI: a misspelled or removed flag fails here."""
    parser = tandem_parser()
    for where, template in pod_templates(render(K8S / overlay)).items():
        for container in template["spec"]["containers"]:
            args = [expand(a, container) for a in container["args"]]
            try:
                parsed = parser.parse_args(args)
            except SystemExit:
                pytest.fail(f"{where}: `tandem {' '.join(args)}` does not parse (see stderr)")
            assert parsed.command == role_of(template), f"{where}: runs {parsed.command}, labelled {role_of(template)}"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_register_with_the_router_service_under_their_pod_identity(overlay):
    objects = render(K8S / overlay)
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    templates = pod_templates(objects)
    router = templates["Deployment/tandem-router"]
    router_container = router["spec"]["containers"][0]
    router_listen = int(flag(router_container["args"], "--listen").rsplit(":", 1)[1])
    workers = {w: t for w, t in templates.items() if role_of(t) in ROLES}
    assert {role_of(t) for t in workers.values()} == set(ROLES), f"{overlay}: a role has no pods"
    for where, template in workers.items():
        c = template["spec"]["containers"][0]
        host, port = flag(c["args"], "--router").removeprefix("tcp://").rsplit(":", 1)
        assert host in services, f"{where}: --router names {host!r}, not a Service ({sorted(services)})"
        svc = services[host]
        assert selects(svc, router), f"{where}: Service {host} does not select the router pods"
        exposed = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
        assert exposed, f"{where}: Service {host} does not expose port {port}"
        assert resolve_port(router_container, exposed[0].get("targetPort", int(port))) == router_listen
        # The router turns ready only once a decode worker registered: registration must not wait for it.
        assert svc["spec"].get("publishNotReadyAddresses") is True
        env = {e["name"]: e for e in c["env"]}
        assert flag(c["args"], "--worker-id") == "$(POD_NAME)"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        listen_port = int(flag(c["args"], "--listen").rsplit(":", 1)[1])
        assert flag(c["args"], "--advertise") == f"tcp://$(POD_IP):{listen_port}"
        resolve_port(c, listen_port)
        if role_of(template) == "decode":  # prefill workers push KV to this address: a fixed, declared port
            kv = flag(c["args"], "--kv-listen")
            assert kv is not None and kv.startswith("tcp://$(POD_IP):"), f"{where}: --kv-listen {kv}"
            resolve_port(c, int(kv.rsplit(":", 1)[1]))


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_clients_reach_the_router_http_and_grpc_ports(overlay):
    objects = render(K8S / overlay)
    router = pod_templates(objects)["Deployment/tandem-router"]
    c = router["spec"]["containers"][0]
    svc = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "tandem-router")
    assert selects(svc, router)
    targets = {p["port"]: resolve_port(c, p["targetPort"]) for p in svc["spec"]["ports"]}
    assert targets == {8000: int(flag(c["args"], "--http-port")), 50051: int(flag(c["args"], "--grpc-port"))}


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_drain_grace_shm_secret_and_user(overlay):
    for where, template in pod_templates(render(K8S / overlay)).items():
        spec = template["spec"]
        c = spec["containers"][0]
        args = c["args"]
        metrics_port = int(flag(args, "--metrics-port"))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe not in c:
                continue
            target = c[probe].get("httpGet") or c[probe].get("tcpSocket")
            port = resolve_port(c, target["port"])
            if role_of(template) in ROLES:  # /health is served on the worker's metrics port
                assert (port, target.get("path")) == (metrics_port, "/health"), f"{where} {probe}"
        assert {"livenessProbe", "readinessProbe"} <= set(c), f"{where}: probes missing"
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port)
        resolve_port(c, metrics_port)
        # SIGTERM drains for --drain-timeout after any preStop hook: the grace period must cover both.
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = spec["terminationGracePeriodSeconds"]
        assert grace > float(flag(args, "--drain-timeout")) + pre_stop_s, f"{where}: grace {grace}s"
        if role_of(template) in ROLES:
            shm = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            assert any(mounts.get(v["name"]) == "/dev/shm" for v in shm), f"{where}: no memory /dev/shm"
            assert "cpu" in c["resources"]["requests"] and "memory" in c["resources"]["requests"]
        secret = {e["name"]: e for e in c["env"]}["TANDEM_LINK_SECRET"]["valueFrom"]["secretKeyRef"]
        assert (secret["name"], secret["key"]) == ("tandem-link-secret", "secret")
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000


# ---- overlay specifics ----------------------------------------------------------------------------

@needs_kubectl
def test_gpu_overlay_asks_for_gpus_and_moves_kv_over_nccl():
    for where, template in pod_templates(render(K8S / "overlays/gpu")).items():
        c = template["spec"]["containers"][0]
        assert c["image"] == "tandem:cuda"
        assert flag(c["args"], "--model") == "/models/model"
        if role_of(template) in ROLES:
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, where
            assert flag(c["args"], "--kv-connector") == "torch_dist", where
            assert c["args"].count("--kv-connector") == 1


def exported_metric_names() -> set[str]:
    """Metric names tandem's code defines (string literals starting tandem_ in the metrics modules)."""
    sources = [ROOT / "router_svc" / "metrics.py", ROOT / "router_svc" / "slo.py",
               *(ROOT / "tandem" / "observability").glob("*.py")]
    return {m for f in sources for m in re.findall(r"[\"'](tandem_[a-z0-9_]+)[\"']", f.read_text())}


@needs_kubectl
def test_autoscalers_target_rendered_workers_on_metrics_tandem_exports():
    objects = render(K8S / "overlays/autoscale")
    hpas = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    exported = exported_metric_names()
    assert "tandem_kv_cache_usage_ratio" in exported  # the scan itself works
    adapter = yaml.safe_load((K8S / "components/autoscale/prometheus-adapter-values.yaml").read_text())
    adapted = {re.match(r"(\w+)", r["seriesQuery"]).group(1) for r in adapter["rules"]["custom"]}
    roles = set()
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments, f"HPA {ref} targets nothing rendered"
        # The HPA owns the replica count; a Deployment that still sets one would be reset on every apply.
        assert "replicas" not in deployments[ref["name"]]["spec"]
        roles.add(role_of(deployments[ref["name"]]["spec"]["template"]))
        for metric in hpa["spec"]["metrics"]:
            name = metric["pods"]["metric"]["name"]
            assert name in exported, f"{name} is not a metric tandem exports"
            assert name in adapted, f"{name} has no prometheus-adapter rule"
    assert roles == set(ROLES)


@needs_kubectl
def test_plan_emits_replicas_that_render_on_an_overlay(tmp_path, capsys):
    from test_planner import make_profile

    from tandem.cli import main as cli_main

    profile = tmp_path / "profile.json"
    make_profile(decode=lambda b, c: 0.001, g=(0.0, 0.0002)).save(str(profile))
    out = tmp_path / "planned"
    code = cli_main(["plan", "--profile", str(profile), "--workload", "prompt=500,output=10", "--rate", "25",
                     "--ttft-slo", "1", "--itl-slo", "0.01", "--workers", "4", "--requests", "500",
                     "--emit-kustomize", str(out), "--kustomize-base", str(K8S / "overlays" / "cpu-demo")])
    assert code == 0, capsys.readouterr().err
    best = re.search(r"best: (\d+)P:(\d+)D", capsys.readouterr().out)
    assert best, "plan printed no P:D pick"
    objects = render(out)
    assert validation_errors(objects) == []
    replicas = {o["metadata"]["name"]: o["spec"]["replicas"] for o in objects if o["kind"] == "Deployment"}
    assert replicas == {"tandem-router": 1, "tandem-prefill": int(best.group(1)), "tandem-decode": int(best.group(2))}


# ---- bad input ------------------------------------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("fixture, field", [
    ("typo-field", "'replica' was unexpected"),
    ("bad-value", "spec.template.spec.terminationGracePeriodSeconds: '45s' is not of type"),
    ("crd-typo", "'groupSize' was unexpected"),
])
def test_broken_overlay_is_refused_naming_the_field(fixture, field):
    errors = validation_errors(render(BROKEN / fixture))
    assert errors, f"{fixture} validated"
    assert any(field in e for e in errors), errors


def test_compose_files_match_the_compose_spec():
    files = [ROOT / "deploy" / "docker-compose.yml", ROOT / "deploy" / "docker-compose.monitoring.yml"]
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           *map(str, files)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_yaml_under_deploy_passes_yamllint():
    proc = subprocess.run([sys.executable, "-m", "yamllint", "-c", str(ROOT / ".yamllint"), "-f", "parsable",
                           str(ROOT / "deploy")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_deploy_files_parse():
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    jobs = {j["job_name"] for j in prom["scrape_configs"]}
    assert {"tandem-router", "tandem-prefill", "tandem-decode"} <= jobs
    prov = ROOT / "deploy/grafana/provisioning"
    ds = yaml.safe_load((prov / "datasources/prometheus.yml").read_text())["datasources"][0]
    dash = json.loads((ROOT / "deploy/grafana/tandem.json").read_text())
    assert all(p["datasource"]["uid"] == ds["uid"] for p in dash["panels"] if "datasource" in p)
    assert yaml.safe_load((prov / "dashboards/tandem.yml").read_text())["providers"]
    compose = [ROOT / "deploy" / f for f in ("docker-compose.yml", "docker-compose.monitoring.yml")]
    services = {}
    for path in compose:
        if path.exists():
            services.update(yaml.safe_load(path.read_text()).get("services") or {})
    for name in ("prometheus", "grafana"):
        assert name in services and "monitoring" in services[name].get("profiles", []), name
