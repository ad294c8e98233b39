"""The Pod Security Standards' ``restricted`` level (baseline included), as a checker for tests.

From kubernetes.io/docs/concepts/security/pod-security-standards (the
rules of the ``latest`` version that a namespace labelled
``pod-security.kubernetes.io/enforce: restricted`` enforces). Each rule
yields a violation string; an empty list means the pod would be admitted.
Windows-only fields (hostProcess) and sysctls beyond the safe set are
checked too; AppArmor and SELinux options only for the values the standard
names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

__all__ = ["pod_specs", "violations"]

#: Restricted: the only volume types allowed.
RESTRICTED_VOLUMES: Final = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                       "persistentVolumeClaim", "projected", "secret"})
#: Baseline: the safe sysctls.
SAFE_SYSCTLS: Final = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                                 "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                                 "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                                 "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"})
_SELINUX_TYPES: Final = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
_PROFILES: Final = frozenset({"RuntimeDefault", "Localhost"})
_VOLUME_META: Final = frozenset({"name"})


def pod_specs(obj: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The pod specs an object creates: ``(where, spec)`` for Pods, workloads and CronJobs."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    spec = obj.get("spec") or {}
    if kind == "Pod":
        yield f"Pod/{name}", spec
    elif kind == "CronJob":
        yield f"CronJob/{name}", spec["jobTemplate"]["spec"]["template"]["spec"]
    elif "template" in spec and "spec" in spec["template"]:
        yield f"{kind}/{name}", spec["template"]["spec"]


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or ()


def violations(spec: Mapping[str, Any]) -> list[str]:
    """Every rule of the restricted level that a pod spec breaks (empty: admitted)."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    # --- baseline
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key} must be unset or false")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod windowsOptions.hostProcess must be unset or false")
    for sysctl in pod_sc.get("sysctls") or ():
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']} is not in the safe set")
    for sc_owner, sc in [("pod", pod_sc)] + [(f"container {c['name']}", c.get("securityContext") or {})
                                             for c in _containers(spec)]:
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in _SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{sc_owner}: seLinuxOptions not allowed")
        apparmor = (sc.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{sc_owner}: appArmorProfile {apparmor} not allowed")
        if sc.get("runAsUser") == 0:
            out.append(f"{sc_owner}: runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is not None and seccomp not in _PROFILES:
            out.append(f"{sc_owner}: seccompProfile {seccomp} not allowed")
    for volume in spec.get("volumes") or ():
        kinds = set(volume) - _VOLUME_META
        if "hostPath" in kinds:
            out.append(f"volume {volume['name']}: hostPath not allowed")
        elif not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: type {sorted(kinds - RESTRICTED_VOLUMES)} not allowed")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in _PROFILES
    for c in _containers(spec):
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"container {name}: privileged must be unset or false")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"container {name}: hostProcess must be unset or false")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"container {name}: procMount must be Default")
        for port in c.get("ports") or ():
            if port.get("hostPort", 0):
                out.append(f"container {name}: hostPort must be unset or 0")
        # --- restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            out.append(f"container {name}: capabilities must drop ALL")
        if set(caps.get("add") or ()) - {"NET_BIND_SERVICE"}:
            out.append(f"container {name}: capabilities may add only NET_BIND_SERVICE")
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot") is True):
            out.append(f"container {name}: runAsNonRoot must be true (pod or container)")
        if not (pod_seccomp or (sc.get("seccompProfile") or {}).get("type") in _PROFILES):
            out.append(f"container {name}: seccompProfile must be RuntimeDefault or Localhost (pod or container)")
    return out
