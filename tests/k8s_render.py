"""Rendering and reading the kustomize manifests under deploy/k8s/ for tests/test_deploy_manifests.py:
`kubectl kustomize`, strict schema validation (kubernetes-validate for built-in kinds, LWS_SCHEMA for the
LeaderWorkerSet), and small readers of the rendered objects (pod templates, flags, ports, selectors)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BROKEN = Path(__file__).resolve().parent / "fixtures" / "k8s_broken"
KUBECTL = shutil.which("kubectl")
# The oldest Kubernetes these manifests claim (autoscaling/v2, LWS's minimum is 1.26) and the newest
# schemas kubernetes-validate has.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
OVERLAYS = ["base", "overlays/cpu-demo", "overlays/gpu", "overlays/autoscale", "overlays/lws"]
ROLES = ("prefill", "decode")

if KUBECTL is None:
    print("test_deploy_manifests: kubectl not found; the kustomize renders are skipped", file=sys.stderr)
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with `kubectl kustomize`) is not installed")

_INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["leaderWorkerTemplate"], "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {"type": "object"},
                "rolloutStrategy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "type": {"const": "RollingUpdate"},
                        "rollingUpdateConfiguration": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"partition": {"type": "integer"}, "maxUnavailable": _INT_OR_STRING,
                                           "maxSurge": _INT_OR_STRING}}}},
                "leaderWorkerTemplate": {
                    "type": "object", "required": ["workerTemplate"], "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
                        "leaderTemplate": {"type": "object"},  # each validated as a core/v1 PodTemplate
                        "workerTemplate": {"type": "object"},
                        "subGroupPolicy": {"type": "object"},
                        "volumeClaimTemplates": {"type": "array"},
                    }},
            }},
    },
}


# ---- rendering and validation ---------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def render(path: Path) -> tuple[dict, ...]:
    proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def name_of(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def validation_errors(objects: tuple[dict, ...]) -> list[str]:
    """One line per object that fails, naming the object, the schema version and the field."""
    errors = []
    for obj in objects:
        for version in K8S_VERSIONS:
            try:
                if obj.get("kind") == "LeaderWorkerSet":
                    validate_lws(obj, version)
                else:
                    kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                errors.append(f"{name_of(obj)}: no schema for {obj.get('apiVersion')} {obj.get('kind')}")
            except jsonschema.ValidationError as exc:
                where = ".".join(str(p) for p in exc.absolute_path)
                errors.append(f"{name_of(obj)} (Kubernetes {version}): {where}: {exc.message}")
    return errors


def validate_lws(obj: dict, version: str) -> None:
    jsonschema.validate(obj, LWS_SCHEMA)
    lwt = obj["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        if key in lwt:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": f"{obj['metadata']['name']}-{key}"},
                                          "template": lwt[key]}, version, strict=True)


def pod_templates(objects: tuple[dict, ...]) -> dict[str, dict]:
    """Every pod template, by where it came from: Deployments, and both templates of a LeaderWorkerSet."""
    out = {}
    for obj in objects:
        if obj["kind"] == "Deployment":
            out[name_of(obj)] = obj["spec"]["template"]
        elif obj["kind"] == "LeaderWorkerSet":
            lwt = obj["spec"]["leaderWorkerTemplate"]
            out[name_of(obj) + "/leader"] = lwt.get("leaderTemplate", lwt["workerTemplate"])
            out[name_of(obj) + "/worker"] = lwt["workerTemplate"]
    return out


def role_of(template: dict) -> str:
    return template["metadata"]["labels"]["app.kubernetes.io/component"]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def expand(value: str, container: dict) -> str:
    """$(VAR) as the kubelet expands it in args, with the downward API fields as placeholders."""
    env = {}
    for e in container.get("env", []):
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[e["name"]] = e.get("value", f"<{field}>" if field else f"<{e['name']}>")
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def resolve_port(container: dict, port: int | str) -> int:
    by_name = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    numbers = {p["containerPort"] for p in container.get("ports", [])}
    if isinstance(port, str):
        assert port in by_name, f"port {port!r} is not a declared container port ({sorted(by_name)})"
        return by_name[port]
    assert port in numbers, f"port {port} is not a declared container port ({sorted(numbers)})"
    return port


def selects(service: dict, template: dict) -> bool:
    labels = template["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


@functools.lru_cache(maxsize=1)
def tandem_parser():
    from tandem.cli import build_parser

    return build_parser()
