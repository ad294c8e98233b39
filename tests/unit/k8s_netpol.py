"""A small evaluator of Kubernetes NetworkPolicy (networking.k8s.io/v1) semantics, for tests.

It answers one question: may a connection from one endpoint reach a port of
another, given a set of NetworkPolicy objects? The rules follow the API
reference and the concept page (kubernetes.io/docs/concepts/services-networking/network-policies):

- A pod is isolated for ingress (egress) when at least one policy of its own
  namespace selects it (``spec.podSelector``) and lists ``Ingress``
  (``Egress``) in its ``policyTypes``. ``policyTypes`` defaults to
  ``["Ingress"]``, plus ``"Egress"`` when the policy has ``egress`` rules.
- A non-isolated direction allows everything; an isolated one allows the
  union of the rules of every policy that selects the pod (policies are
  additive, there is no deny).
- A rule allows a peer when the peer matches any entry of ``from`` (``to``)
  and the port matches any entry of ``ports``; an absent or empty ``from``
  (``to``) matches every peer, absent or empty ``ports`` every port.
- A peer entry: ``podSelector`` alone selects pods of the policy's namespace;
  ``namespaceSelector`` alone every pod of the matching namespaces; both
  together, pods that match the pod selector in namespaces that match the
  namespace selector; ``ipBlock`` an address in ``cidr`` and in no ``except``.
- A label selector: every ``matchLabels`` pair and every ``matchExpressions``
  entry (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``) must hold; the empty
  selector matches everything.
- A port entry: ``protocol`` defaults to TCP; ``port`` is a number or the name
  of a container port of the destination pod; ``endPort`` makes a range.
- A connection needs the source's egress and the destination's ingress.
  Traffic between a pod and its own node (the kubelet's probes) is always
  allowed, as is a pod's traffic to itself.

Hosts (nodes, addresses outside the cluster) are endpoints without a
namespace: no policy selects them, and only ``ipBlock`` peers match them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["Endpoint", "allowed", "selector_matches"]

_OPERATORS: Final = ("In", "NotIn", "Exists", "DoesNotExist")
_PROTOCOLS: Final = ("TCP", "UDP", "SCTP")


@dataclass(frozen=True)
class Endpoint:
    """One end of a connection: a pod (``namespace`` set) or a host (``namespace`` None).

    Attributes
    ----------
    name : str
        For messages only.
    ip : str
        Its address (matched by ``ipBlock`` peers).
    node : str
        The node it runs on (a host: the node it is, or "" outside the cluster).
    namespace : str or None
        The pod's namespace; None for a host.
    labels : Mapping[str, str]
        The pod's labels.
    namespace_labels : Mapping[str, str]
        Its namespace's labels (``kubernetes.io/metadata.name`` is added, as the API server does).
    ports : Mapping[str, int]
        Named container ports (for policies that name a port).
    """

    name: str
    ip: str
    node: str = ""
    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        """The namespace's labels with the name label every namespace carries."""
        if self.namespace is None:
            raise ValueError(f"{self.name} is a host: it has no namespace")
        return {**self.namespace_labels, "kubernetes.io/metadata.name": self.namespace}


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector matches ``labels`` (None, like ``{}``, matches everything).

    Raises
    ------
    ValueError
        On an unknown operator, or values that do not fit it (the API server refuses those).
    """
    if selector is None:
        return True
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(f"label selector: unknown fields {sorted(unknown)}")
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op not in _OPERATORS:
            raise ValueError(f"label selector: unknown operator {op!r}")
        if op in ("In", "NotIn") and not values:
            raise ValueError(f"label selector: {op} needs values")
        if op in ("Exists", "DoesNotExist") and values:
            raise ValueError(f"label selector: {op} takes no values")
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def _policy_types(spec: Mapping[str, Any]) -> set[str]:
    if "policyTypes" in spec:
        return set(spec["policyTypes"])
    return {"Ingress", "Egress"} if "egress" in spec else {"Ingress"}


def _peer_matches(peer: Mapping[str, Any], policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if set(peer) != {"ipBlock"}:
            raise ValueError("a peer with ipBlock has no other selector")
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(other.ip)
        if ip not in ipaddress.ip_network(block["cidr"]):
            return False
        return not any(ip in ipaddress.ip_network(e) for e in block.get("except") or ())
    if not peer:
        raise ValueError("a peer needs podSelector, namespaceSelector or ipBlock")
    if other.namespace is None:
        return False  # selectors select pods only
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], other.ns_labels()):
            return False
    elif other.namespace != policy_ns:
        return False
    return selector_matches(peer.get("podSelector"), other.labels)


def _port_matches(entries: Iterable[Mapping[str, Any]] | None, port: int, protocol: str,
                  dest: Endpoint) -> bool:
    entries = list(entries or ())
    if not entries:
        return True
    for entry in entries:
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry:
            return True  # every port of that protocol
        want = entry["port"]
        if isinstance(want, str):
            if "endPort" in entry:
                raise ValueError("endPort needs a numeric port")
            if dest.ports.get(want) == port:
                return True
            continue
        if want <= port <= entry.get("endPort", want):
            return True
    return False


def _direction_allows(policies: Iterable[Mapping[str, Any]], pod: Endpoint, other: Endpoint, port: int,
                      protocol: str, direction: str, dest: Endpoint) -> bool:
    """Whether ``pod``'s policies allow ``other`` in ``direction`` ("Ingress" or "Egress")."""
    if pod.namespace is None:
        return True  # hosts are not subject to NetworkPolicy
    isolated = False
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in policies:
        meta, spec = policy["metadata"], policy["spec"]
        if meta.get("namespace") != pod.namespace or not selector_matches(spec["podSelector"], pod.labels):
            continue
        if direction not in _policy_types(spec):
            continue
        isolated = True
        for rule in spec.get(key) or ():
            peers = rule.get(peers_key) or []
            if peers and not any(_peer_matches(p, meta["namespace"], other) for p in peers):
                continue
            if _port_matches(rule.get("ports"), port, protocol, dest):
                return True
    return not isolated


def allowed(policies: Iterable[Mapping[str, Any]], source: Endpoint, dest: Endpoint, port: int,
            protocol: str = "TCP") -> bool:
    """Whether ``source`` may open a connection to ``dest``'s ``port``/``protocol``.

    Raises
    ------
    ValueError
        On an unknown protocol, or a policy the API server would refuse.
    """
    if protocol not in _PROTOCOLS:
        raise ValueError(f"protocol: one of {_PROTOCOLS}, got {protocol!r}")
    policies = [p for p in policies if p.get("kind") == "NetworkPolicy"]
    if source == dest:
        return True
    if source.node and source.node == dest.node and (source.namespace is None or dest.namespace is None):
        return True  # a node and its own pods
    return (_direction_allows(policies, source, dest, port, protocol, "Egress", dest)
            and _direction_allows(policies, dest, source, port, protocol, "Ingress", dest))
