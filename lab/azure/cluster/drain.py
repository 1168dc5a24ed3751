"""The lab's drain of one worker: cordon its node, then evict its pod, as ``kubectl drain`` does.

The eviction is the Eviction API (``policy/v1``, ``pods/{name}/eviction``): a graceful deletion
that honours PodDisruptionBudgets. The kubelet sends the worker SIGTERM and waits the pod's
``terminationGracePeriodSeconds``, in which the worker saves the last completed step (the same
path as a Spot eviction's notice); the training operator recreates the pod, the survivors
re-form the group, and nothing trained is lost. Cordoning first keeps the new pod off the node
it left. Every failure is a ``ClusterError`` in one line.
"""

from __future__ import annotations

from kubernetes import client as k8s
from urllib3.exceptions import HTTPError as Urllib3Error

from lab.azure.cluster.kube import Cluster, ClusterError, explain


def cordon(cluster: Cluster, node: str, unschedulable: bool = True) -> None:
    """Mark ``node`` unschedulable (``kubectl cordon``), or schedulable again."""
    body = {"spec": {"unschedulable": unschedulable}}
    what = f"node {node} ({'cordon' if unschedulable else 'uncordon'})"
    try:
        cluster.core.patch_node(node, body)
    except (k8s.ApiException, Urllib3Error, OSError) as err:
        raise explain(err, what) from None


def evict(cluster: Cluster, pod: str) -> None:
    """Evict ``pod`` through the Eviction API; refused (a budget, 429) or gone (404): said."""
    namespace = cluster.target.namespace
    body = k8s.V1Eviction(
        api_version="policy/v1",
        kind="Eviction",
        metadata=k8s.V1ObjectMeta(name=pod, namespace=namespace),
    )
    try:
        cluster.core.create_namespaced_pod_eviction(pod, namespace, body)
    except k8s.ApiException as err:
        if err.status == 429:
            raise ClusterError(
                f"the eviction of {pod} was refused (429): a PodDisruptionBudget allows no "
                "disruption now; try again later"
            ) from None
        raise explain(err, f"pod {pod} (eviction)") from None
    except (Urllib3Error, OSError) as err:
        raise explain(err, f"pod {pod} (eviction)") from None
