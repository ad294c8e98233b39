"""What a plain Prometheus scrapes of a rendered overlay: Kubernetes discovery and relabelling, for tests.

The scrape jobs are the prometheus Helm chart's own (``tests/fixtures/k8s/prometheus-chart-scrape-jobs.yaml``,
with the commit they came from); this module gives them the targets Prometheus's Kubernetes discovery
would (prometheus.io/docs/prometheus/latest/configuration/configuration/#kubernetes_sd_config):

* ``role: pod``: one target per declared container port, ``__address__`` the pod IP and that port, with
  ``__meta_kubernetes_pod_annotation_<name>``, ``_pod_label_<name>``, ``_pod_ip``, ``_pod_name``,
  ``_pod_phase``, ``_pod_node_name`` and ``__meta_kubernetes_namespace``;
* ``role: endpointslice``: one target per ready pod behind the Service and per Service port, at the pod IP
  and the port's target, with ``__meta_kubernetes_service_annotation_<name>`` and ``_service_label_<name>``,
  ``_service_name`` and the pod's metadata;

and relabels them as Prometheus does (``keep``, ``drop``, ``replace``, ``labelmap``; regexes anchored at
both ends, YAML scalars read as strings (``regex: true`` is "true"); ``source_labels`` joined by ``;``; a missing label is empty; labels starting with ``__`` are
dropped after relabelling, except ``__address__``, ``__metrics_path__`` and ``__scheme__``, which make the
URL).  Names are sanitized as Prometheus does: every character outside ``[a-zA-Z0-9_]`` becomes ``_``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import yaml

JOBS_FILE: Final = Path(__file__).resolve().parents[1] / "fixtures" / "k8s" / "prometheus-chart-scrape-jobs.yaml"


def jobs() -> dict[str, Any]:
    return yaml.safe_load(JOBS_FILE.read_text())  # type: ignore[no-any-return]


def _name(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", text)


def _meta(prefix: str, kind: str, values: Mapping[str, str]) -> dict[str, str]:
    return {f"__meta_kubernetes_{prefix}_{kind}_{_name(k)}": v for k, v in values.items()}


def pod_targets(pod: Mapping[str, Any], ip: str, node: str) -> list[dict[str, str]]:
    """``role: pod`` targets of a pod template (as a running pod with ``ip`` on ``node``)."""
    meta = pod["metadata"]
    base = {
        "__meta_kubernetes_namespace": meta.get("namespace", ""),
        "__meta_kubernetes_pod_name": meta.get("name", "server-0"),
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_node_name": node,
        **_meta("pod", "annotation", meta.get("annotations") or {}),
        **_meta("pod", "label", meta.get("labels") or {}),
    }
    ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    return [{**base, "__address__": f"{ip}:{port}"} for port in ports] or [{**base, "__address__": ip}]


def endpoint_targets(service: Mapping[str, Any], pod: Mapping[str, Any], ip: str, node: str) -> list[dict[str, str]]:
    """``role: endpointslice`` targets of a Service for one pod behind it."""
    named = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    meta = service["metadata"]
    base = {
        "__meta_kubernetes_namespace": meta.get("namespace", ""),
        "__meta_kubernetes_service_name": meta["name"],
        "__meta_kubernetes_pod_name": pod["metadata"].get("name", "server-0"),
        "__meta_kubernetes_pod_node_name": node,
        **_meta("service", "annotation", meta.get("annotations") or {}),
        **_meta("service", "label", meta.get("labels") or {}),
    }
    out = []
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        number = named[target] if isinstance(target, str) else target
        out.append({**base, "__address__": f"{ip}:{number}"})
    return out


def _text(value: object) -> str:
    """A YAML scalar as Prometheus's Go structs read it into a string field (``regex: true`` is "true")."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _substitute(replacement: str, match: re.Match[str]) -> str:
    return re.sub(r"\$\{?(\d+)\}?", lambda m: match.group(int(m.group(1))) or "", replacement)


def relabel(labels: Mapping[str, str], configs: Iterable[Mapping[str, Any]]) -> dict[str, str] | None:
    """Apply ``relabel_configs``; None when the target is dropped."""
    out = dict(labels)
    for rule in configs:
        action = rule.get("action", "replace")
        regex = re.compile(f"(?:{_text(rule.get('regex', '(.*)'))})\\Z")
        if action == "labelmap":
            replacement = rule.get("replacement", "$1")
            for name, value in list(out.items()):
                m = regex.match(name)
                if m:
                    out[_substitute(replacement, m)] = value
            continue
        value = rule.get("separator", ";").join(out.get(s, "") for s in rule.get("source_labels", []))
        m = regex.match(value)
        if action == "keep" and not m:
            return None
        if action == "drop" and m:
            return None
        if action == "replace" and m:
            new = _substitute(str(rule.get("replacement", "$1")), m)
            if new:
                out[rule["target_label"]] = new
            else:
                out.pop(rule["target_label"], None)
    return out


def scrape_urls(targets: Iterable[Mapping[str, str]], job: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The URLs a job scrapes of these targets, each with the labels its series get (one entry per URL:
    Prometheus merges targets whose labels are equal)."""
    urls: dict[str, dict[str, str]] = {}
    for target in targets:
        labels = relabel(target, job.get("relabel_configs", []))
        if labels is None:
            continue
        url = (f"{labels.get('__scheme__', 'http')}://{labels['__address__']}"
               f"{labels.get('__metrics_path__', job.get('metrics_path', '/metrics'))}")
        urls[url] = {k: v for k, v in labels.items() if not k.startswith("__")}
    return urls
