"""Ready-to-paste kubectl lines to follow the job: a stack output (``watchCommands``)."""

from __future__ import annotations

from workloads.manifests.job import JOB_NAME_LABEL
from workloads.manifests.scheduling import RENDEZVOUS_LABELS, ROLE_LABEL, gpu_nodes_selector


def watch_commands(
    namespace: str, job: str, max_replicas: int, fallback: bool = False
) -> dict[str, str]:
    """Ready-to-paste kubectl lines to follow the job."""
    pods = f"-l {JOB_NAME_LABEL}={job}"
    etcd = f"-l {ROLE_LABEL}={RENDEZVOUS_LABELS[ROLE_LABEL]}"
    return {
        "jobs": f"kubectl get pytorchjobs -n {namespace}",
        "describe": f"kubectl describe pytorchjob {job} -n {namespace}",
        "pods": f"kubectl get pods -n {namespace} {pods} -o wide --watch",
        # One stream per worker; kubectl's default cap is 5.
        "logs": (
            f"kubectl logs -f -n {namespace} {pods} --prefix "
            f"--max-log-requests={max(5, max_replicas)}"
        ),
        "events": f"kubectl get events -n {namespace} --sort-by=.lastTimestamp --watch",
        "rendezvous": f"kubectl get pods -n {namespace} {etcd} -o wide",
        "gpu_nodes": (
            f"kubectl get nodes -l {gpu_nodes_selector(fallback)} "
            "-L kubernetes.azure.com/scalesetpriority,node.kubernetes.io/instance-type"
        ),
    }
