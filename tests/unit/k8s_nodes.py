"""Managed Kubernetes GPU nodes as the scheduler sees them, and whether a pod spec fits one, for tests.

A node here is what the cloud gives before any operator of ours touches it:
its labels, its taints and its allocatable resources, computed from the
capacity with each provider's own reservation formula (sources below, with
the commit or page each came from).  :func:`unschedulable` answers the
scheduler's filter questions for one pod spec on one node: the node selector
(``nodeSelector`` and required node affinity ``matchLabels``-style terms),
the ``NoSchedule``/``NoExecute`` taints against the pod's tolerations, and
the effective requests (the larger of the largest init container and the sum
of the containers, plus what the node's DaemonSets already take) against
allocatable.

Sources
-------
GKE   reserved CPU 6 % of the first core, 1 % of the next, 0.5 % of the next 2,
      0.25 % above 4; memory 25 % of the first 4 GiB, 20 % of the next 4, 10 %
      of the next 8, 6 % of the next 112, 2 % above 128, plus a 100 MiB
      eviction threshold (cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes,
      as implemented in cloudpilot-ai/karpenter-provider-gcp@417f047b pkg/utils/utils.go).
      GPU pools carry ``cloud.google.com/gke-accelerator`` and the taint
      ``nvidia.com/gpu=present:NoSchedule`` (when the cluster has a non-GPU pool).
EKS   awslabs/amazon-eks-ami@81fec2e8 nodeadm/internal/kubelet/config.go:
      kube-reserved memory 11 x maxPods + 255 MiB, CPU as GKE's tiers,
      eviction 100 MiB; maxPods from eni_max_pods (58 for g5/g6 xlarge-2xlarge);
      capacity 7.5 % below the instance's memory (Karpenter's VM memory
      overhead, aws/karpenter-provider-aws@1d927085, whose published
      allocatable these formulas reproduce).  No GPU label or taint on a
      managed node group below Kubernetes 1.35.
AKS   MicrosoftDocs/azure-aks-docs@fb060abe articles/aks/node-resource-reservations.md
      (1.29+): kube-reserved memory min(20 MB x maxPods + 50 MB, 25 % of
      memory) plus a 100 MiB eviction threshold; CPU 140m at 4 cores, 180m at 8,
      260m at 16 (10m per core in between); maxPods 250 (Azure CNI overlay).
      GPU pools: ``accelerator=nvidia``, and the taint the GPU docs recommend,
      ``sku=gpu:NoSchedule`` (use-nvidia-gpu.md).

GKE's and AKS's reported memory capacity is below the machine's nominal size
(firmware and kernel): :data:`CAPACITY_SHORTFALL` of it is taken off.  The
DaemonSets of a GPU node (device plugin, kube-proxy, CNI, CSI and logging
agents) take :data:`DAEMONSETS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

GIB: Final = 1024**3
MIB: Final = 1024**2
#: Nominal memory the kubelet does not see on GKE and AKS machines (AKS's NC6: 56 GiB nominal, 55.0 reported).
CAPACITY_SHORTFALL: Final = 0.03
#: What a GPU node's DaemonSets request before our pod (CPU cores, memory bytes); measured ranges are
#: 250-500m and 300-700 MiB (GKE's device plugin alone: 50m / 100 MiB).
DAEMONSETS: Final = (0.5, 1 * GIB)
#: Node boot disk every shape is given (GKE's and AKS's defaults are 100 and 128 GB; EKS's 20 GiB is
#: too small for the image: deploy/k8s/README.md), the unpacked GPU image on it, and the kubelet's
#: nodefs eviction threshold (10 %).
DISK: Final = 100 * GIB
IMAGE: Final = 30 * GIB


def _tiered(amount: float, tiers: list[tuple[float, float]], rest: float) -> float:
    reserved, left = 0.0, amount
    for size, rate in tiers:
        part = min(left, size)
        reserved += part * rate
        left -= part
    return reserved + max(left, 0.0) * rest


def _cpu_reserved(cores: float) -> float:
    """GKE's and EKS's kube-reserved CPU, in cores."""
    return _tiered(cores, [(1, 0.06), (1, 0.01), (2, 0.005)], 0.0025)


def gke_allocatable(cores: int, memory_gib: float) -> tuple[float, float]:
    capacity = memory_gib * GIB * (1 - CAPACITY_SHORTFALL)
    gib = capacity / GIB
    reserved = _tiered(gib, [(4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06)], 0.02) * GIB + 100 * MIB
    return cores - _cpu_reserved(cores), capacity - reserved


def eks_allocatable(cores: int, memory_gib: float, max_pods: int) -> tuple[float, float]:
    capacity = memory_gib * GIB * (1 - 0.075)
    return cores - _cpu_reserved(cores), capacity - (11 * max_pods + 255) * MIB - 100 * MIB


def aks_allocatable(cores: int, memory_gib: float, max_pods: int = 250) -> tuple[float, float]:
    capacity = memory_gib * GIB * (1 - CAPACITY_SHORTFALL)
    table = {4: 0.14, 8: 0.18, 16: 0.26}
    cpu = table.get(cores, 0.14 + 0.01 * (cores - 4))
    memory = min((20 * max_pods + 50) * 1_000_000, 0.25 * capacity) + 100 * MIB
    return cores - cpu, capacity - memory


@dataclass(frozen=True)
class Node:
    """A GPU node as the scheduler sees it: ``cpu`` in cores, memory and storage in bytes."""

    name: str
    cpu: float
    memory: float
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect)
    gpus: int = 1
    disk: float = DISK


GKE_GPU_TAINT: Final = (("nvidia.com/gpu", "present", "NoSchedule"),)
AKS_GPU_TAINT: Final = (("sku", "gpu", "NoSchedule"),)


def gke(name: str, cores: int, memory_gib: float, accelerator: str) -> Node:
    cpu, memory = gke_allocatable(cores, memory_gib)
    return Node(f"GKE {name}", cpu, memory, {"cloud.google.com/gke-accelerator": accelerator}, GKE_GPU_TAINT)


def eks(name: str, cores: int, memory_gib: float, max_pods: int, disk: float = DISK) -> Node:
    cpu, memory = eks_allocatable(cores, memory_gib, max_pods)
    return Node(f"EKS {name}", cpu, memory, {"node.kubernetes.io/instance-type": name}, disk=disk)


def aks(name: str, cores: int, memory_gib: float) -> Node:
    cpu, memory = aks_allocatable(cores, memory_gib)
    return Node(f"AKS {name}", cpu, memory, {"accelerator": "nvidia"}, AKS_GPU_TAINT)


_UNITS: Final = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "k": 1000, "M": 1000**2, "G": 1000**3,
                 "m": 0.001}


def quantity(value: object) -> float:
    """A Kubernetes resource quantity (``"6"``, ``"500m"``, ``"24Gi"``, ``1``) as a number."""
    text = str(value)
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _UNITS[suffix]
    return float(text)


def requests(spec: Mapping[str, Any]) -> dict[str, float]:
    """The pod's effective requests: max(largest init container, sum of containers), per resource."""
    def of(container: Mapping[str, Any]) -> dict[str, float]:
        return {k: quantity(v) for k, v in (container.get("resources", {}).get("requests") or {}).items()}

    total: dict[str, float] = {}
    for c in spec.get("containers", []):
        for k, v in of(c).items():
            total[k] = total.get(k, 0.0) + v
    for c in spec.get("initContainers", []):
        for k, v in of(c).items():
            total[k] = max(total.get(k, 0.0), v)
    return total


def _tolerated(taint: tuple[str, str, str], tolerations: list[Mapping[str, Any]]) -> bool:
    key, value, effect = taint
    for t in tolerations:
        if t.get("effect") not in (None, "", effect):
            continue
        if t.get("operator", "Equal") == "Exists":
            if t.get("key") in (None, "", key):
                return True
        elif t.get("key") == key and t.get("value", "") == value:
            return True
    return False


def unschedulable(spec: Mapping[str, Any], node: Node) -> list[str]:
    """Why the scheduler would not place a pod of ``spec`` on ``node`` (empty: it fits)."""
    reasons = [f"node selector {k}={v} not on the node" for k, v in (spec.get("nodeSelector") or {}).items()
               if node.labels.get(k) != v]
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if affinity is not None:
        reasons.append("required node affinity is not evaluated here")
    reasons += [f"taint {k}={v}:{e} not tolerated" for k, v, e in node.taints
                if e in ("NoSchedule", "NoExecute") and not _tolerated((k, v, e), spec.get("tolerations") or [])]
    want = requests(spec)
    have = {"cpu": node.cpu - DAEMONSETS[0], "memory": node.memory - DAEMONSETS[1], "nvidia.com/gpu": node.gpus,
            "ephemeral-storage": node.disk * 0.9 - IMAGE}
    for resource, amount in sorted(want.items()):
        if amount > have.get(resource, 0.0):
            reasons.append(f"{resource}: requests {amount:g}, the node has {have.get(resource, 0.0):g} left")
    return reasons
