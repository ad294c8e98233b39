"""deploy/k8s read as a cluster would: NetworkPolicy semantics, Pod Security, storage, scaling, stop budgets.

Offline (no cluster here): the overlays rendered by the project's kubectl
(tests/unit/test_k8s.py ``rendered``), the policies evaluated by
tests/unit/k8s_netpol.py, the pod specs checked by
tests/unit/k8s_podsecurity.py, both tested here on hand-written inputs first.
``pytest -k networkpolicy`` selects the policy tests.
"""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit import k8s_nodes, k8s_prometheus
from tests.unit.k8s_netpol import Endpoint, allowed, selector_matches
from tests.unit.k8s_podsecurity import pod_specs, violations
from tests.unit.test_deploy_images import hadolint
from tests.unit.test_k8s import K8S, OVERLAYS, REPO, objects, rendered, tool

NS = "constrained-llm"
SERVER_LABELS = {"app.kubernetes.io/name": NS, "app.kubernetes.io/part-of": NS,
                 "app.kubernetes.io/component": "server"}
SERVER_PORTS = {"grpc": 8001, "openai": 8080, "http": 8000, "metrics": 8002, "health": 8003}
EXAMPLES = sorted((K8S / "examples").glob("*.yaml"))


def docs(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered(overlay)) if d]


def pod(name: str, namespace: str, labels: dict[str, str] | None = None, *, node: str = "node-a",
        ip: str = "10.0.0.9", ns_labels: dict[str, str] | None = None,
        ports: dict[str, int] | None = None) -> Endpoint:
    return Endpoint(name, ip, node, namespace, labels or {}, ns_labels or {}, ports or {})


SERVER = pod("server", NS, SERVER_LABELS, ip="10.0.1.5", ports=SERVER_PORTS)
CLIENT_ELSEWHERE = pod("README client in apps", "apps", {"constrained-llm/client": "true"}, node="node-b")
CLIENT_SAME_NS = pod("client in constrained-llm", NS, {"constrained-llm/client": "true"})
UNLABELLED = pod("unlabelled pod", "apps", node="node-b")
UNLABELLED_SAME_NS = pod("unlabelled pod in constrained-llm", NS)
PROMETHEUS = pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}, node="node-c")
KUBE_DNS = pod("coredns", "kube-system", {"k8s-app": "kube-dns"}, ip="10.0.2.10", node="node-c")
FAKE_DNS = pod("kube-dns label elsewhere", "apps", {"k8s-app": "kube-dns"}, node="node-b")
OWN_NODE = Endpoint("kubelet on the server's node", "192.168.0.1", "node-a")
OTHER_NODE = Endpoint("another node", "192.168.0.2", "node-b")
INTERNET = Endpoint("an address outside the cluster", "203.0.113.7")
FILL = pod("model fill", NS, {"app.kubernetes.io/name": NS, "app.kubernetes.io/part-of": NS,
                              "app.kubernetes.io/component": "model-fill"})


# ------------------------------------------------------------------- the evaluator on hand-written policies
def policy(spec: dict[str, Any], namespace: str = "prod") -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": namespace}, "spec": spec}


WEB = pod("web", "prod", {"app": "web"}, ports={"http": 8080})
FRONT = pod("front", "prod", {"role": "front", "tier": "a"}, node="n2")
FRONT_OTHER_NS = pod("front in dev", "dev", {"role": "front"}, node="n2", ns_labels={"team": "x"})
BARE = pod("bare", "dev", node="n2")

ONLY_WEB = {"podSelector": {"matchLabels": {"app": "web"}}}
EVALUATOR_CASES = [
    # (what, policies, source, dest, port, protocol, allowed)
    ("no policy: open", [], BARE, WEB, 8080, "TCP", True),
    ("ingress isolation with no rule denies", [policy({**ONLY_WEB, "policyTypes": ["Ingress"]})],
     FRONT, WEB, 8080, "TCP", False),
    ("policyTypes default to Ingress", [policy(ONLY_WEB)], FRONT, WEB, 8080, "TCP", False),
    ("egress not isolated by an Ingress policy", [policy(ONLY_WEB)], WEB, FRONT, 80, "TCP", True),
    ("an egress list implies Egress", [policy({**ONLY_WEB, "egress": [{"ports": [{"port": 53}]}]})],
     WEB, FRONT, 80, "TCP", False),
    ("a rule with no from and no ports allows all", [policy({**ONLY_WEB, "ingress": [{}]})],
     BARE, WEB, 1, "UDP", True),
    ("podSelector alone: same namespace", [policy({**ONLY_WEB, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"role": "front"}}}]}]})], FRONT, WEB, 8080, "TCP", True),
    ("podSelector alone: not another namespace", [policy({**ONLY_WEB, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"role": "front"}}}]}]})], FRONT_OTHER_NS, WEB, 8080, "TCP",
     False),
    ("both selectors in one peer: AND", [policy({**ONLY_WEB, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "x"}}, "podSelector": {"matchLabels": {"role": "front"}}}]}]})],
     BARE, WEB, 8080, "TCP", False),
    ("both selectors in one peer: both match", [policy({**ONLY_WEB, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "x"}}, "podSelector": {"matchLabels": {"role": "front"}}}]}]})],
     FRONT_OTHER_NS, WEB, 8080, "TCP", True),
    ("two peers: OR", [policy({**ONLY_WEB, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "x"}}}, {"podSelector": {"matchLabels": {"role": "front"}}}]}]})],
     BARE, WEB, 8080, "TCP", False),
    ("namespaceSelector alone: every pod there", [policy({**ONLY_WEB, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dev"}}}]}]})],
     BARE, WEB, 8080, "TCP", True),
    ("matchExpressions In", [policy({**ONLY_WEB, "ingress": [{"from": [{"podSelector": {"matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["a", "b"]}]}}]}]})], FRONT, WEB, 8080, "TCP", True),
    ("matchExpressions NotIn", [policy({**ONLY_WEB, "ingress": [{"from": [{"podSelector": {"matchExpressions": [
        {"key": "tier", "operator": "NotIn", "values": ["a"]}]}}]}]})], FRONT, WEB, 8080, "TCP", False),
    ("matchExpressions DoesNotExist", [policy({**ONLY_WEB, "ingress": [{"from": [{"namespaceSelector": {},
        "podSelector": {"matchExpressions": [{"key": "role", "operator": "DoesNotExist"}]}}]}]})],
     BARE, WEB, 8080, "TCP", True),
    ("matchLabels and matchExpressions: AND", [policy({**ONLY_WEB, "ingress": [{"from": [{"podSelector": {
        "matchLabels": {"role": "front"}, "matchExpressions": [{"key": "tier", "operator": "Exists"}]}}]}]})],
     FRONT, WEB, 8080, "TCP", True),
    ("protocol defaults to TCP", [policy({**ONLY_WEB, "ingress": [{"ports": [{"port": 8080}]}]})],
     FRONT, WEB, 8080, "UDP", False),
    ("a named port is the destination's", [policy({**ONLY_WEB, "ingress": [{"ports": [{"port": "http"}]}]})],
     FRONT, WEB, 8080, "TCP", True),
    ("endPort range", [policy({**ONLY_WEB, "ingress": [{"ports": [{"port": 8000, "endPort": 8079}]}]})],
     FRONT, WEB, 8080, "TCP", False),
    ("policies are additive", [policy({**ONLY_WEB, "ingress": [{"ports": [{"port": 1}]}]}),
                               policy({**ONLY_WEB, "ingress": [{"ports": [{"port": 8080}]}]})],
     FRONT, WEB, 8080, "TCP", True),
    ("a policy of another namespace does not select", [policy({"podSelector": {}, "policyTypes": ["Ingress"]},
                                                              "dev")], FRONT, WEB, 8080, "TCP", True),
    ("egress of the source counts too", [policy({"podSelector": {}, "policyTypes": ["Egress"]}, "dev")],
     BARE, WEB, 8080, "TCP", False),
    ("ipBlock with except", [policy({**ONLY_WEB, "egress": [{"to": [{"ipBlock": {
        "cidr": "203.0.113.0/24", "except": ["203.0.113.0/29"]}}]}]})], WEB, INTERNET, 443, "TCP", False),
    ("ipBlock", [policy({**ONLY_WEB, "egress": [{"to": [{"ipBlock": {"cidr": "203.0.113.0/24"}}]}]})],
     WEB, INTERNET, 443, "TCP", True),
    ("the pod's own node always", [policy({**ONLY_WEB, "policyTypes": ["Ingress"]})],
     Endpoint("kubelet", "192.168.0.1", "node-a"), WEB, 8080, "TCP", True),
    ("another node is a host like any other", [policy({**ONLY_WEB, "policyTypes": ["Ingress"]})],
     Endpoint("node", "192.168.0.2", "n9"), WEB, 8080, "TCP", False),
]


@pytest.mark.parametrize(("what", "policies", "source", "dest", "port", "protocol", "expected"), EVALUATOR_CASES,
                         ids=[c[0] for c in EVALUATOR_CASES])
def test_networkpolicy_evaluator_follows_the_api(what: str, policies: list[dict[str, Any]], source: Endpoint,
                                                 dest: Endpoint, port: int, protocol: str, expected: bool) -> None:
    assert allowed(policies, source, dest, port, protocol) is expected, what


@pytest.mark.parametrize(("selector", "message"), [
    ({"matchExpressions": [{"key": "a", "operator": "Equals", "values": ["b"]}]}, "unknown operator 'Equals'"),
    ({"matchExpressions": [{"key": "a", "operator": "In"}]}, "In needs values"),
    ({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["b"]}]}, "Exists takes no values"),
    ({"matchLabel": {"a": "b"}}, r"unknown fields \['matchLabel'\]"),
])
def test_networkpolicy_evaluator_refuses_invalid_selectors(selector: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        selector_matches(selector, {"a": "b"})


def test_networkpolicy_evaluator_sees_the_includeselectors_defect(tmp_path: Path) -> None:
    """The issue's rendering: `includeSelectors: true` over our policy blocks the README client and DNS."""
    shutil.copy(K8S / "base" / "networkpolicy.yaml", tmp_path / "networkpolicy.yaml")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NS,
        "labels": [{"pairs": {"app.kubernetes.io/name": NS, "app.kubernetes.io/part-of": NS},
                    "includeSelectors": True}],
        "resources": ["networkpolicy.yaml"]}))
    out = subprocess.run([tool("kubectl"), "kustomize", str(tmp_path)], capture_output=True, text=True, check=True)
    old = list(yaml.safe_load_all(out.stdout))
    assert not allowed(old, CLIENT_ELSEWHERE, SERVER, 8001)
    assert not allowed(old, SERVER, KUBE_DNS, 53, "UDP")
    assert allowed(docs("cpu"), CLIENT_ELSEWHERE, SERVER, 8001)


# ------------------------------------------------------------------- the rendered policies
RENDERED_CASES = [
    # (source, dest, port, protocol, allowed)
    (CLIENT_ELSEWHERE, SERVER, 8001, "TCP", True),
    (CLIENT_SAME_NS, SERVER, 8001, "TCP", True),
    (CLIENT_ELSEWHERE, SERVER, 8080, "TCP", True),  # the OpenAI-compatible API
    (CLIENT_SAME_NS, SERVER, 8080, "TCP", True),
    (PROMETHEUS, SERVER, 8080, "TCP", False),
    (UNLABELLED, SERVER, 8080, "TCP", False),
    (OTHER_NODE, SERVER, 8080, "TCP", False),
    (CLIENT_ELSEWHERE, SERVER, 8001, "UDP", False),
    (CLIENT_ELSEWHERE, SERVER, 8002, "TCP", False),
    (CLIENT_ELSEWHERE, SERVER, 8000, "TCP", False),
    (PROMETHEUS, SERVER, 8002, "TCP", True),
    (PROMETHEUS, SERVER, 8003, "TCP", True),  # the gateway's metrics on the launcher's port
    (PROMETHEUS, SERVER, 8001, "TCP", False),
    (UNLABELLED, SERVER, 8001, "TCP", False),
    (UNLABELLED, SERVER, 8002, "TCP", False),
    (UNLABELLED, SERVER, 8003, "TCP", False),
    (UNLABELLED_SAME_NS, SERVER, 8001, "TCP", False),
    (OTHER_NODE, SERVER, 8001, "TCP", False),
    (OWN_NODE, SERVER, 8003, "TCP", True),  # the kubelet's probes
    (SERVER, KUBE_DNS, 53, "UDP", True),
    (SERVER, KUBE_DNS, 53, "TCP", True),
    (SERVER, KUBE_DNS, 54, "UDP", False),
    (SERVER, FAKE_DNS, 53, "UDP", False),
    (SERVER, INTERNET, 443, "TCP", False),
    (SERVER, CLIENT_ELSEWHERE, 8001, "TCP", False),
]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize(("source", "dest", "port", "protocol", "expected"), RENDERED_CASES,
                         ids=[f"{c[0].name}->{c[1].name}:{c[2]}/{c[3]}" for c in RENDERED_CASES])
def test_networkpolicy_rendered_admits_what_the_readme_says(overlay: str, source: Endpoint, dest: Endpoint,
                                                            port: int, protocol: str, expected: bool) -> None:
    assert allowed(docs(overlay), source, dest, port, protocol) is expected


@pytest.mark.parametrize(("source", "dest", "port", "protocol"), [
    (FILL, KUBE_DNS, 53, "UDP"), (FILL, INTERNET, 443, "TCP"), (CLIENT_SAME_NS, FILL, 8001, "TCP"),
    (FILL, SERVER, 8001, "TCP")])
def test_networkpolicy_model_fill_job_is_isolated(source: Endpoint, dest: Endpoint, port: int,
                                                  protocol: str) -> None:
    assert not allowed(docs("gpu"), source, dest, port, protocol)


def test_networkpolicy_smoke_client_carries_the_admitted_label() -> None:
    (job,) = yaml.safe_load_all((K8S / "examples" / "smoke-client.yaml").read_text())
    labels = job["spec"]["template"]["metadata"]["labels"]
    client = pod("smoke", job["metadata"]["namespace"], labels)
    assert allowed(docs("cpu"), client, SERVER, 8001)
    assert not allowed(docs("cpu"), client, SERVER, 8002)


# ------------------------------------------------------------------- Pod Security (restricted)
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


@pytest.mark.parametrize(("spec", "expected"), [
    ({"securityContext": RESTRICTED_POD, "containers": [{"name": "c", "securityContext": RESTRICTED_CONTAINER}]},
     []),
    # What `kubectl run` (the README's old smoke client) creates.
    ({"containers": [{"name": "client"}]}, [
        "container client: allowPrivilegeEscalation must be false", "container client: capabilities must drop ALL",
        "container client: runAsNonRoot must be true (pod or container)",
        "container client: seccompProfile must be RuntimeDefault or Localhost (pod or container)"]),
    ({"securityContext": {**RESTRICTED_POD, "runAsUser": 0}, "hostNetwork": True,
      "volumes": [{"name": "h", "hostPath": {"path": "/"}}, {"name": "n", "nfs": {"server": "x", "path": "/"}}],
      "containers": [{"name": "c", "ports": [{"containerPort": 1, "hostPort": 1}], "securityContext": {
          **RESTRICTED_CONTAINER, "privileged": True, "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]},
          "runAsNonRoot": False, "seccompProfile": {"type": "Unconfined"}}}]}, [
        "hostNetwork must be unset or false", "pod: runAsUser must not be 0",
        "container c: seccompProfile Unconfined not allowed", "volume h: hostPath not allowed",
        "volume n: type ['nfs'] not allowed", "container c: privileged must be unset or false",
        "container c: hostPort must be unset or 0", "container c: capabilities may add only NET_BIND_SERVICE",
        "container c: runAsNonRoot must be true (pod or container)"]),
    ({"securityContext": RESTRICTED_POD, "initContainers": [{"name": "i"}],
      "containers": [{"name": "c", "securityContext": RESTRICTED_CONTAINER}]}, [
        "container i: allowPrivilegeEscalation must be false", "container i: capabilities must drop ALL"]),
])
def test_restricted_checker_finds_each_violation(spec: dict[str, Any], expected: list[str]) -> None:
    assert violations(spec) == expected


def _all_pod_specs() -> list[tuple[str, Mapping[str, Any]]]:
    out = []
    for overlay in OVERLAYS:
        for doc in docs(overlay):
            out += [(f"{overlay}: {where}", spec) for where, spec in pod_specs(doc)]
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            out += [(f"{path.name}: {where}", spec) for where, spec in pod_specs(doc)]
    return out


@pytest.mark.parametrize(("where", "spec"), _all_pod_specs(), ids=[w for w, _ in _all_pod_specs()])
def test_every_pod_passes_restricted_pod_security(where: str, spec: Mapping[str, Any]) -> None:
    assert violations(spec) == []
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_enforces_restricted(overlay: str) -> None:
    namespace = objects(overlay)[("Namespace", NS)]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert {d["metadata"].get("namespace") for d in docs(overlay) if d["kind"] != "Namespace"} == {NS}


@pytest.mark.parametrize("version", ("1.34.0", "1.37.0"))
def test_examples_pass_the_kubernetes_schemas(version: str) -> None:
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", version, *map(str, EXAMPLES)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    count = sum(1 for path in EXAMPLES for d in yaml.safe_load_all(path.read_text()) if d)
    assert (out.stdout + out.stderr).count(" passed for resource ") == count == 3


# ------------------------------------------------------------------- storage
def _storage_class_patches(overlay: str) -> list[str]:
    kust = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    values = []
    for patch in kust.get("patches") or ():
        if patch.get("target", {}).get("kind") == "PersistentVolumeClaim":
            (op,) = yaml.safe_load(patch["patch"])
            assert op["path"] == "/spec/storageClassName"
            values.append(op["value"])
    return values


def test_storage_class_is_set_in_one_place_per_overlay() -> None:
    for path in [*(K8S / "base").glob("*.yaml"), *(K8S / "overlays").glob("*/*.yaml")]:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "PersistentVolumeClaim":
                assert "storageClassName" not in doc["spec"], path  # only the overlay's patch sets it
    for overlay in ("cpu", "gpu"):
        (name,) = _storage_class_patches(overlay)
        claims = [d for d in docs(overlay) if d["kind"] == "PersistentVolumeClaim"]
        assert claims and {c["spec"]["storageClassName"] for c in claims} == {name}
        assert {m for c in claims for m in c["spec"]["accessModes"]} == {"ReadWriteMany"}


def test_store_per_pod_needs_no_claim() -> None:
    objs = objects("cpu-store-per-pod")
    assert not [k for k in objs if k[0] == "PersistentVolumeClaim"]
    spec = objs[("Deployment", NS)]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    limit = {v["name"]: v for v in spec["volumes"]}["grammar-store"]["emptyDir"]["sizeLimit"]
    assert limit == "2Gi" and int(env["GRAMMAR_STORE_MAX_BYTES"]) < 2 * 1024**3


def test_gpu_model_volume_is_filled_before_the_server_reads_it() -> None:
    objs = objects("gpu")
    job = objs[("Job", "constrained-llm-model-fill")]["spec"]["template"]["spec"]
    (fill,) = job["containers"]
    assert fill["image"] == "registry.example.com/constrained-llm-model:model-0.1.0"
    assert {m["name"]: m["mountPath"] for m in fill["volumeMounts"]} == {"model": "/models/hf"}
    marker = "/models/hf/.fill-complete"
    assert 'mv "$dst/.fill-complete.tmp" "$dst/.fill-complete"' in fill["command"][2]
    server = objs[("Deployment", NS)]["spec"]["template"]["spec"]
    (wait,) = server["initContainers"]
    assert f"until [ -f {marker} ]" in wait["command"][2]
    assert {v["name"]: v for v in server["volumes"]}["model"]["persistentVolumeClaim"] == {
        "claimName": "constrained-llm-model", "readOnly": True}
    dockerfile = K8S / "overlays" / "gpu" / "model-image" / "Dockerfile"
    assert dockerfile.read_text().count("COPY --chown=10001:10001 . /model/") == 1  # the Job copies /model
    out = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, check=False)
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


# ------------------------------------------------------------------- TLS and keys
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_tls_and_keys_come_from_required_secrets(overlay: str) -> None:
    spec = objects(overlay)[("Deployment", NS)]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert env["GATEWAY_TLS_CLIENT_CA"] == ""
    for var, volume, secret in (("GATEWAY_TLS_CERT", "tls", "constrained-llm-tls"),
                                ("GATEWAY_TLS_KEY", "tls", "constrained-llm-tls"),
                                ("GATEWAY_API_KEYS_FILE", "api-keys", "constrained-llm-api-keys")):
        assert Path(env[var]).parent == Path(mounts[volume]["mountPath"])
        assert "subPath" not in mounts[volume]  # a subPath mount never sees a rotated Secret
        assert volumes[volume]["secret"]["secretName"] == secret
        assert "optional" not in volumes[volume]["secret"]


# ------------------------------------------------------------------- availability and scaling
def _disruptions_allowed(pdb: dict[str, Any], expected: int, healthy: int) -> int:
    """policy/v1 PodDisruptionBudget status.disruptionsAllowed for integer budgets."""
    spec = pdb["spec"]
    desired_healthy = spec["minAvailable"] if "minAvailable" in spec else expected - spec["maxUnavailable"]
    return max(0, healthy - max(0, desired_healthy))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_node_drain_never_evicts_the_last_replica(overlay: str) -> None:
    objs = objects(overlay)
    pdb, hpa = objs[("PodDisruptionBudget", NS)], objs[("HorizontalPodAutoscaler", NS)]
    assert hpa["spec"]["minReplicas"] >= 2
    for replicas in range(hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"] + 1):
        assert _disruptions_allowed(pdb, replicas, replicas) == 1  # a drain progresses, one pod at a time
        assert _disruptions_allowed(pdb, replicas, replicas - 1) == 0  # and waits for the replacement


def test_pdb_disruption_arithmetic_can_fail() -> None:
    """The issue's GPU budget: one replica, maxUnavailable 1, lets a drain evict it."""
    assert _disruptions_allowed({"spec": {"maxUnavailable": 1}}, 1, 1) == 1
    assert _disruptions_allowed({"spec": {"minAvailable": 1}}, 1, 1) == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_strategy_fits_the_hardware(overlay: str) -> None:
    objs = objects(overlay)
    deploy = objs[("Deployment", NS)]
    rolling = deploy["spec"]["strategy"]["rollingUpdate"]
    assert "replicas" not in deploy["spec"]
    if overlay == "gpu":  # no spare GPU: replace in place, one at a time, one replica keeps serving
        assert rolling == {"maxSurge": 0, "maxUnavailable": 1}
        assert objs[("HorizontalPodAutoscaler", NS)]["spec"]["minReplicas"] > rolling["maxUnavailable"]
    else:
        assert rolling == {"maxSurge": 1, "maxUnavailable": 0}


def _stop_budget_s() -> dict[str, float]:
    """The launcher's stop steps after preStop, each at its limit, from deploy/ itself."""
    from deploy import drain, gateway, launch

    scrape_timeout = inspect.signature(drain.scrape).parameters["timeout_s"].default
    return {
        "drain last scrape": float(scrape_timeout),
        "drain poll": float(inspect.signature(drain.drain).parameters["poll_s"].default),
        "supervisor join": launch.SUPERVISOR_JOIN_S,
        "gateway stop": inspect.signature(gateway.Gateway.stop).parameters["grace_s"].default
        + gateway.STOP_JOIN_SLACK_S,
        "tritonserver stop grace": launch._parse_args(["--model-repository", "x"]).stop_grace,
    }


@pytest.mark.parametrize(("overlay", "grace"), [("cpu", 570), ("gpu", 300), ("cpu-store-per-pod", 570)])
def test_grace_period_covers_the_worst_case_stop(overlay: str, grace: int) -> None:
    """terminationGracePeriodSeconds >= preStop drain timeout + every stop step of deploy/launch.py."""
    spec = objects(overlay)[("Deployment", NS)]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    drain_timeout = float(command[command.index("--timeout") + 1])
    assert "--stop-grace" not in " ".join(container.get("args", []))  # the launcher's default applies
    worst = drain_timeout + sum(_stop_budget_s().values())
    assert spec["terminationGracePeriodSeconds"] == grace
    assert worst <= grace, f"{overlay}: worst-case stop {worst:g} s > grace {grace} s"
    # The manifests' comments state the same sum.
    assert re.search(rf"sum\s+{int(worst)} s", _comment_source(overlay)), worst


def _comment_source(overlay: str) -> str:
    if overlay == "gpu":
        return (K8S / "overlays" / "gpu" / "deployment-patch.yaml").read_text()
    return (K8S / "base" / "deployment.yaml").read_text()


def test_grace_arithmetic_would_catch_the_old_gpu_grace() -> None:
    """The issue's figures: drain 150 s and the stop steps exceed the old 200 s."""
    assert 150 + sum(_stop_budget_s().values()) > 200


# ------------------------------------------------------------------- monitoring
def _engine_published(path: str) -> set[str]:
    return set(re.findall(r'snap\.put\("([a-z_]+)"', (REPO / path).read_text()))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_metrics_are_served_by_the_adapter_and_published_by_the_engine(overlay: str) -> None:
    rules = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    assert values["rules"]["custom"] == rules  # the fresh install serves the same rules
    served = {r["name"]["as"] for r in rules}
    for rule in rules:
        assert rule["seriesQuery"] == f'{rule["name"]["as"]}{{namespace="{NS}",pod!=""}}'
    hpa = objects(overlay)[("HorizontalPodAutoscaler", NS)]
    metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert metrics <= served
    if overlay == "gpu":
        published = _engine_published("llm_runtime/trtllm_engine.py")
        assert metrics == {"llm_live_requests", "llm_waiting_requests"} and metrics <= published


@pytest.mark.parametrize("overlay", ["gpu+prometheus-operator", "cpu+prometheus-operator"])
def test_servicemonitor_carries_the_kube_prometheus_stack_label(overlay: str) -> None:
    monitor = objects(overlay)[("ServiceMonitor", NS)]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_plain_prometheus_scrapes_both_metrics_ports_with_the_labels_the_adapter_needs(overlay: str) -> None:
    """The prometheus chart's own annotation jobs (fixture with its commit), on the rendered pod and Service:
    Triton's port through the pod, the launcher's through the Service's endpoints; the series carry the
    namespace and pod labels that the adapter's rules query (prometheus-adapter-rules.yaml)."""
    objs = objects(overlay)
    pod_template = objs[("Deployment", NS)]["spec"]["template"]
    pod_template = {**pod_template, "metadata": {**pod_template["metadata"], "namespace": NS, "name": "server-0"}}
    service = objs[("Service", NS)]
    scrape = k8s_prometheus.jobs()
    urls = k8s_prometheus.scrape_urls(k8s_prometheus.pod_targets(pod_template, "10.0.1.5", "node-a"),
                                      scrape["kubernetes-pods"])
    urls.update(k8s_prometheus.scrape_urls(
        k8s_prometheus.endpoint_targets(service, pod_template, "10.0.1.5", "node-a"),
        scrape["kubernetes-service-endpoints"]))
    assert sorted(urls) == ["http://10.0.1.5:8002/metrics", "http://10.0.1.5:8003/metrics"]
    pod_labels = urls["http://10.0.1.5:8002/metrics"]
    assert (pod_labels["namespace"], pod_labels["pod"]) == (NS, "server-0")
    rules = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    assert all("namespace=" in r["seriesQuery"] and "pod!=" in r["seriesQuery"] for r in rules)
    # And the NetworkPolicy lets a Prometheus in the monitoring namespace reach both.
    assert allowed(docs(overlay), PROMETHEUS, SERVER, 8002) and allowed(docs(overlay), PROMETHEUS, SERVER, 8003)


def test_prometheus_relabelling_can_drop_a_target() -> None:
    """The evaluator's keep rule bites: a pod without the annotation is not scraped."""
    pod_template = {"metadata": {"name": "p", "namespace": NS, "labels": {}},
                    "spec": {"containers": [{"ports": [{"name": "metrics", "containerPort": 8002}]}]}}
    assert k8s_prometheus.scrape_urls(k8s_prometheus.pod_targets(pod_template, "10.0.0.1", "n"),
                                      k8s_prometheus.jobs()["kubernetes-pods"]) == {}


# ------------------------------------------------------------------- scheduling on managed GPU nodes
#: Single-GPU node shapes: the default GPU overlay must fit the first group; the smaller ones need
#: components/gpu-small-node, and fit with it. The README's table says the same (checked below).
GPU_NODES_DEFAULT = [
    k8s_nodes.gke("g2-standard-8", 8, 32, "nvidia-l4"),
    k8s_nodes.gke("g2-standard-16", 16, 64, "nvidia-l4"),
    k8s_nodes.gke("a2-highgpu-1g", 12, 85, "nvidia-tesla-a100"),
    k8s_nodes.eks("g5.2xlarge", 8, 32, 58),
    k8s_nodes.eks("g6.2xlarge", 8, 32, 58),
    k8s_nodes.eks("g5.4xlarge", 16, 64, 234),
    k8s_nodes.eks("g6e.2xlarge", 8, 64, 58),
    k8s_nodes.aks("Standard_NC8as_T4_v3", 8, 56),
    k8s_nodes.aks("Standard_NC24ads_A100_v4", 24, 220),
]
GPU_NODES_SMALL = [
    k8s_nodes.eks("g5.xlarge", 4, 16, 58),
    k8s_nodes.aks("Standard_NC4as_T4_v3", 4, 28),
]


def _server_pod(overlay: str) -> dict[str, Any]:
    return objects(overlay)[("Deployment", NS)]["spec"]["template"]["spec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("node", GPU_NODES_DEFAULT, ids=lambda n: n.name)
def test_gpu_overlay_schedules_on_common_single_gpu_nodes(node: k8s_nodes.Node) -> None:
    spec = _server_pod("gpu")
    assert k8s_nodes.unschedulable(spec, node) == []
    (container,) = spec["containers"]
    # A pod at its memory limit must not push the node into memory pressure.
    assert k8s_nodes.quantity(container["resources"]["limits"]["memory"]) <= node.memory


@pytest.mark.parametrize("node", GPU_NODES_SMALL, ids=lambda n: n.name)
def test_small_gpu_nodes_take_the_small_node_component(node: k8s_nodes.Node) -> None:
    assert k8s_nodes.unschedulable(_server_pod("gpu"), node) != []
    spec = _server_pod("gpu+gpu-small-node")
    assert k8s_nodes.unschedulable(spec, node) == []
    (container,) = spec["containers"]
    assert k8s_nodes.quantity(container["resources"]["limits"]["memory"]) <= node.memory


def test_the_old_gpu_pod_would_stay_pending() -> None:
    """The issue's findings, through the same evaluator: a gpu.present node selector and 8 CPU / 32 GiB."""
    old = {**_server_pod("gpu"), "nodeSelector": {"nvidia.com/gpu.present": "true"}}
    old["containers"] = [{**old["containers"][0], "resources": {"requests": {"cpu": "8", "memory": "32Gi",
                                                                             "nvidia.com/gpu": 1}}}]
    gke, eks = GPU_NODES_DEFAULT[0], GPU_NODES_DEFAULT[3]
    assert k8s_nodes.unschedulable(old, gke)[0] == "node selector nvidia.com/gpu.present=true not on the node"
    assert any(r.startswith("cpu: requests 8,") for r in k8s_nodes.unschedulable(old, eks))
    # And an EKS node group's default 20 GiB disk cannot hold the image and /tmp (README: 100 GiB or more).
    small_disk = k8s_nodes.eks("g5.2xlarge", 8, 32, 58, disk=20 * k8s_nodes.GIB)
    assert any(r.startswith("ephemeral-storage") for r in k8s_nodes.unschedulable(_server_pod("gpu"), small_disk))


def test_readme_lists_every_node_shape_with_its_verdict() -> None:
    text = (K8S / "README.md").read_text()
    for node, verdict in [*((n, "default") for n in GPU_NODES_DEFAULT),
                          *((n, "gpu-small-node") for n in GPU_NODES_SMALL)]:
        provider, shape = node.name.split(" ", 1)
        assert re.search(rf"^\| {provider} \| `{re.escape(shape)}` \|.*\| {verdict} \|$", text, re.MULTILINE), shape


@pytest.mark.parametrize("overlay", [*OVERLAYS, "gpu+gpu-small-node"])
def test_ephemeral_storage_covers_the_pods_disk_volumes(overlay: str) -> None:
    """The kubelet evicts a pod whose containers and disk-backed emptyDirs together pass its containers'
    ephemeral-storage limits: those limits must hold every such volume at its sizeLimit."""
    spec = _server_pod(overlay)
    disk_volumes = sum(k8s_nodes.quantity(v["emptyDir"].get("sizeLimit", 0)) for v in spec["volumes"]
                       if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")
    limits = [c.get("resources", {}).get("limits", {}).get("ephemeral-storage") for c in spec["containers"]]
    if overlay.startswith("gpu"):
        assert None not in limits  # set explicitly: the caches in /tmp are large
    if None not in limits:
        assert sum(k8s_nodes.quantity(x) for x in limits) > disk_volumes
    memory_volumes = sum(k8s_nodes.quantity(v["emptyDir"]["sizeLimit"]) for v in spec["volumes"]
                         if v.get("emptyDir", {}).get("medium") == "Memory")
    assert memory_volumes < k8s_nodes.quantity(spec["containers"][0]["resources"]["limits"]["memory"])


#: What a new pod may wait through between two steps of a rollout, each at its budget (seconds): a node
#: scaled up (GPU: until the GPU is allocatable, up to 15 min per the cluster autoscaler's notes), the image
#: pulled (CPU ~2 GB; GPU 16-18 GB compressed from nvcr.io), the GPU model volume filled on a first
#: install; then the startup probe's whole budget.
ROLLOUT_WAITS = {
    "cpu": {"node": 300, "pull": 180},
    "gpu": {"node": 900, "pull": 600, "model fill": 600},
}


@pytest.mark.parametrize("overlay", [*OVERLAYS, "gpu+gpu-small-node"])
def test_progress_deadline_outlasts_a_pod_coming_up(overlay: str) -> None:
    """Past progressDeadlineSeconds `kubectl rollout status` reports a failed rollout (exit 1) while the pod
    is still coming up: it must exceed the waits of a new pod, the startup probe's budget included."""
    deploy = objects(overlay)[("Deployment", NS)]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    probe = container["startupProbe"]
    startup = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    waits = sum(ROLLOUT_WAITS["gpu" if overlay.startswith("gpu") else "cpu"].values()) + startup
    deadline = deploy["spec"].get("progressDeadlineSeconds", 600)
    assert deadline >= waits, f"{overlay}: progressDeadlineSeconds {deadline} < {waits}"
    if overlay == "gpu":
        assert 600 < waits  # Kubernetes' default would fail the README's `kubectl rollout status`
        assert re.search(rf"sum\s+{waits} s", (K8S / "overlays" / "gpu" / "deployment-patch.yaml").read_text())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_spread_over_nodes_and_the_store_is_not_chowned_each_start(overlay: str) -> None:
    spec = _server_pod(overlay)
    assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    (spread,) = spec["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"], spread["maxSkew"]) == (
        "kubernetes.io/hostname", "ScheduleAnyway", 1)
    labels = objects(overlay)[("Deployment", NS)]["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(spread["labelSelector"], labels)


def test_networkpolicy_expose_example_admits_outside_clients_on_grpc_only() -> None:
    example = list(yaml.safe_load_all((K8S / "examples" / "expose-tls.yaml").read_text()))
    service = next(d for d in example if d["kind"] == "Service")
    assert service["spec"]["selector"] == objects("cpu")[("Service", NS)]["spec"]["selector"]
    assert service["spec"]["externalTrafficPolicy"] == "Local"  # keeps the client's address for ipBlock
    policies = docs("cpu") + example
    assert allowed(policies, INTERNET, SERVER, 8001)
    assert not allowed(policies, INTERNET, SERVER, 8002)
    assert not allowed(policies, INTERNET, SERVER, 8003)
    assert not allowed(docs("cpu"), INTERNET, SERVER, 8001)  # the example is what opens it
