"""The lab namespace's one exception to Pod Security ``baseline``: ``IPC_LOCK``, for InfiniBand.

Pod Security admission has no per-capability exceptions: a namespace enforces ``baseline`` whole,
and ``baseline`` allows a container to add only ``AUDIT_WRITE, CHOWN, DAC_OVERRIDE, FOWNER,
FSETID, KILL, MKNOD, NET_BIND_SERVICE, SETFCAP, SETGID, SETPCAP, SETUID, SYS_CHROOT``
(Kubernetes, "Pod Security Standards", Baseline, Capabilities), not the ``IPC_LOCK`` NCCL needs to
pin its InfiniBand buffers. So with InfiniBand on, the namespace enforces ``privileged`` (and
still audits ``baseline``), and a ValidatingAdmissionPolicy bound to it refuses what
``baseline`` refuses, each control of that page in CEL, with ``IPC_LOCK`` the one capability
added to its list. (ValidatingAdmissionPolicy is GA in Kubernetes 1.30, admissionregistration
.k8s.io/v1; AKS offers only later versions.) Pure: builds plain dicts.
"""

from __future__ import annotations

from typing import Any

from workloads.manifests.network_operator import IPC_LOCK

BASELINE_CAPABILITIES = (
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
)  # fmt: skip
# Baseline's safe sysctls and SELinux types (the same page, "Sysctls" and "SELinux").
SAFE_SYSCTLS = (
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
)  # fmt: skip
SELINUX_TYPES = ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t")
NAME = "baseline-with-ipc-lock"


def _strings(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _context(field: str, allowed: str) -> str:
    """Every container's ``securityContext.<field>`` absent or ``allowed`` (CEL over the typed
    pod: each level is tested with ``has`` before it is read)."""
    c = "c.securityContext"
    return f"variables.containers.all(c, !has({c}) || !has({c}.{field}) || ({allowed}))"


def _pod_context(field: str, allowed: str) -> str:
    p = "object.spec.securityContext"
    return f"!has({p}) || !has({p}.{field}) || ({allowed})"


def _rules() -> list[tuple[str, str]]:
    """(CEL expression, what it refuses): every container, init and ephemeral ones included."""
    c = "c.securityContext"
    capabilities = _strings((*BASELINE_CAPABILITIES, IPC_LOCK))
    spec = "object.spec"
    return [
        (
            f"!(has({spec}.hostNetwork) && {spec}.hostNetwork) && "
            f"!(has({spec}.hostPID) && {spec}.hostPID) && !(has({spec}.hostIPC) && {spec}.hostIPC)",
            "host namespaces (hostNetwork, hostPID, hostIPC)",
        ),
        (_context("privileged", f"!{c}.privileged"), "privileged containers"),
        (
            _context(
                "capabilities",
                f"!has({c}.capabilities.add) || {c}.capabilities.add.all(x, x in {capabilities})",
            ),
            f"capabilities beyond baseline's and {IPC_LOCK}",
        ),
        (
            f"!has({spec}.volumes) || {spec}.volumes.all(v, !has(v.hostPath))",
            "hostPath volumes",
        ),
        (
            "variables.containers.all(c, !has(c.ports) || "
            "c.ports.all(p, !has(p.hostPort) || p.hostPort == 0))",
            "host ports",
        ),
        (
            _context(
                "windowsOptions",
                f"!has({c}.windowsOptions.hostProcess) || !{c}.windowsOptions.hostProcess",
            ),
            "HostProcess containers",
        ),
        (_context("procMount", f"{c}.procMount == 'Default'"), "a /proc mount type"),
        (
            _pod_context(
                "seccompProfile", f"{spec}.securityContext.seccompProfile.type != 'Unconfined'"
            ),
            "an Unconfined seccomp profile (pod)",
        ),  # fmt: skip
        (
            _context("seccompProfile", f"{c}.seccompProfile.type != 'Unconfined'"),
            "an Unconfined seccomp profile",
        ),
        (
            _context("appArmorProfile", f"{c}.appArmorProfile.type != 'Unconfined'"),
            "an Unconfined AppArmor profile",
        ),
        (
            _context(
                "seLinuxOptions",
                f"(!has({c}.seLinuxOptions.type) || {c}.seLinuxOptions.type in "
                f"{_strings(SELINUX_TYPES)}) && !has({c}.seLinuxOptions.user) && "
                f"!has({c}.seLinuxOptions.role)",
            ),
            "SELinux options beyond baseline's",
        ),
        (
            _pod_context(
                "sysctls",
                f"{spec}.securityContext.sysctls.all(s, s.name in {_strings(SAFE_SYSCTLS)})",
            ),
            "unsafe sysctls",
        ),
    ]


def baseline_with_ipc_lock(namespace: str) -> list[dict[str, Any]]:
    """The policy and its binding to ``namespace``: its pods as baseline allows them, plus
    ``IPC_LOCK``."""
    containers = (
        "object.spec.containers + "
        "(has(object.spec.initContainers) ? object.spec.initContainers : []) + "
        "(has(object.spec.ephemeralContainers) ? object.spec.ephemeralContainers : [])"
    )
    validations = [
        {"expression": expression, "message": f"Pod Security baseline (with {IPC_LOCK}): {what}"}
        for expression, what in _rules()
    ]
    pods = {
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "operations": ["CREATE", "UPDATE"],
        "resources": ["pods", "pods/ephemeralcontainers"],
    }
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": f"{namespace}-{NAME}"},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [pods]},
                "variables": [{"name": "containers", "expression": containers}],
                "validations": validations,
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": f"{namespace}-{NAME}"},
            "spec": {
                "policyName": f"{namespace}-{NAME}",
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        },
    ]


def namespace_labels(allow_ipc_lock: bool) -> dict[str, str]:
    """Pod Security labels: ``baseline`` enforced; with the exception, ``privileged`` enforced
    and ``baseline`` audited, the policy above doing the enforcing."""
    if not allow_ipc_lock:
        return {"pod-security.kubernetes.io/enforce": "baseline"}
    return {
        "pod-security.kubernetes.io/enforce": "privileged",
        "pod-security.kubernetes.io/audit": "baseline",
    }
