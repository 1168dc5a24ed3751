"""Evict one node of the GPU Spot pool on a real AKS lab: the cloud twin of the local lab's faults.

Azure's "simulate eviction" makes a Spot VM go through a real eviction: the node gets the
Preempt scheduled event (at least 30 s of notice), AKS drains it best effort, the pods get
SIGTERM, and then the VM is gone. It works only on Spot VMs, so it is the honest way to test that
the elastic job survives losing a node.

The GPU pool is a VM scale set in the cluster's node resource group. AKS names it
``aks-<pool>-<digits>-vmss`` and tags it ``aks-managed-poolName=<pool>``; its nodes are named
``aks-<pool>-<digits>-vmss<6 base-36 digits of the instance id>``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from azure.core.exceptions import ClientAuthenticationError, HttpResponseError
from azure.mgmt.compute import ComputeManagementClient
from azure.mgmt.compute.models import VirtualMachineScaleSet, VirtualMachineScaleSetVM

from catalog.gpu_pools import NODE
from lab.azure.clients import AzureError, credential_from_env
from stack_config import LabConfig
from training.elastic.exit_codes import BAD_INPUT

POOL_TAG = "aks-managed-poolName"
# A dataclass field's plain default is also its class attribute: the stack's default namespace.
DEFAULT_NAMESPACE: str = LabConfig.namespace

ClientFactory = Callable[[str], AbstractContextManager[ComputeManagementClient]]
PodResolver = Callable[[str, str], str]


class EvictionError(Exception):
    """The eviction cannot go ahead; the message names what is missing and how to fix it."""


@dataclass(frozen=True)
class EvictionRequest:
    """What the user asked for, after flags, stack outputs and environment are merged."""

    subscription: str
    resource_group: str
    pool: str
    instance_id: str | None = None
    node: str | None = None
    pod: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    dry_run: bool = False


@dataclass(frozen=True)
class EvictionTarget:
    """One VM of the pool's scale set, resolved against Azure."""

    resource_group: str
    scale_set: str
    instance_id: str
    node: str | None
    """The Kubernetes node name (the VM's computer name), when Azure reports it."""

    def describe(self) -> str:
        """A one-line, human-readable name of the target."""
        node = f"node {self.node} " if self.node else ""
        return (
            f"{node}(instance {self.instance_id} of scale set {self.scale_set}"
            f" in resource group {self.resource_group})"
        )


def parse_node_name(node: str) -> tuple[str, str]:
    """Split an AKS node name into its scale set name and VMSS instance id.

    ``aks-gpu1a2b3c4d-12345678-vmss00000a`` -> ``("aks-gpu1a2b3c4d-12345678-vmss", "10")``.
    """
    match = NODE.match(node)
    if match is None:
        raise EvictionError(
            f"--node {node!r} is not an AKS scale-set node name; expected "
            "aks-<pool>-<digits>-vmss<6 base-36 characters>, e.g. "
            "aks-gpu1a2b3c4d-12345678-vmss00000a "
            "(see `kubectl get nodes`), or pass --instance-id"
        )
    scale_set = f"aks-{match['pool']}-{match['digits']}-vmss"
    return scale_set, str(int(match["suffix"], 36))


def read_stack_outputs(path: Path) -> dict[str, object]:
    """Read the JSON written by ``pulumi stack output --json --show-secrets``."""
    try:
        outputs = json.loads(path.read_text())
    except OSError as err:
        raise EvictionError(f"--stack-outputs {path}: cannot read it ({err.strerror})") from err
    except json.JSONDecodeError as err:
        raise EvictionError(
            f"--stack-outputs {path} is not JSON ({err.msg}); write it with "
            "`pulumi stack output --json --show-secrets > FILE`"
        ) from err
    if not isinstance(outputs, dict):
        raise EvictionError(f"--stack-outputs {path} must hold a JSON object of stack outputs")
    return outputs


def request_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> EvictionRequest:
    """Merge flags, stack outputs and ``AZURE_SUBSCRIPTION_ID``; flags win."""
    outputs = read_stack_outputs(args.stack_outputs) if args.stack_outputs else {}
    subscription = args.subscription or environ.get("AZURE_SUBSCRIPTION_ID")
    if not subscription:
        raise EvictionError(
            "no subscription: pass --subscription or set AZURE_SUBSCRIPTION_ID "
            "(`az account show --query id -o tsv` prints the current one)"
        )
    resource_group = args.node_resource_group or outputs.get("nodeResourceGroup")
    if not isinstance(resource_group, str) or not resource_group:
        where = f" (--stack-outputs {args.stack_outputs} has none)" if args.stack_outputs else ""
        raise EvictionError(
            f"no node resource group{where}: pass --node-resource-group (the cluster's MC_... "
            "group) or --stack-outputs FILE holding nodeResourceGroup, written by "
            "`pulumi stack output --json --show-secrets`"
        )
    # The pool's name follows its create-only settings (infra/node_pools.py), so it comes from
    # the stack's outputs, not from a fixed default.
    pool = args.pool or outputs.get("gpuPoolName")
    if not isinstance(pool, str) or not pool:
        where = f" (--stack-outputs {args.stack_outputs} has none)" if args.stack_outputs else ""
        raise EvictionError(
            f"no GPU pool name{where}: pass --pool (e.g. gpu1a2b3c4d, see `az aks nodepool "
            "list`) or --stack-outputs FILE holding gpuPoolName"
        )
    return EvictionRequest(
        subscription=subscription,
        resource_group=resource_group,
        pool=pool,
        instance_id=args.instance_id,
        node=args.node,
        pod=args.pod,
        namespace=args.namespace,
        dry_run=args.dry_run,
    )


def pool_scale_set(
    scale_sets: Sequence[VirtualMachineScaleSet], pool: str, resource_group: str
) -> VirtualMachineScaleSet:
    """Pick the pool's scale set by AKS's pool tag, or else by AKS's naming scheme."""
    by_tag = [s for s in scale_sets if (s.tags or {}).get(POOL_TAG) == pool]
    named = re.compile(rf"^aks-{re.escape(pool)}-\d+-vmss$")
    matches = by_tag or [s for s in scale_sets if named.match(s.name or "")]
    found = ", ".join(sorted(s.name or "?" for s in scale_sets)) or "none"
    if len(matches) != 1:
        problem = "no scale set" if not matches else "more than one scale set"
        raise EvictionError(
            f"{problem} for pool {pool!r} in resource group {resource_group} "
            f"(scale sets found: {found}); pass --pool with the GPU pool's name, "
            "or check --node-resource-group"
        )
    scale_set = matches[0]
    profile = scale_set.virtual_machine_profile
    # The SDK hands back an enum; its .value is the wire string ("Spot", "Regular").
    priority = getattr(profile, "priority", None)
    priority = getattr(priority, "value", priority)
    if str(priority).lower() != "spot":
        raise EvictionError(
            f"scale set {scale_set.name} of pool {pool!r} is not Spot (priority {priority}); "
            "Azure can simulate evictions only of Spot VMs, so pass --pool with the Spot pool"
        )
    return scale_set


def _is_running(vm: VirtualMachineScaleSetVM) -> bool:
    statuses = vm.instance_view.statuses if vm.instance_view is not None else None
    return any(status.code == "PowerState/running" for status in statuses or [])


def choose_instance(
    vms: Sequence[VirtualMachineScaleSetVM], wanted: str | None, scale_set: str
) -> VirtualMachineScaleSetVM:
    """The VM with instance id ``wanted``, or the running VM with the lowest instance id."""
    ids = sorted((vm.instance_id or "" for vm in vms), key=lambda i: (len(i), i))
    present = ", ".join(ids) or "none"
    if wanted is not None:
        for vm in vms:
            if vm.instance_id == wanted:
                return vm
        raise EvictionError(
            f"instance {wanted} not found in scale set {scale_set} (instances: {present}); "
            "the node may already be gone, see `kubectl get nodes`"
        )
    running = sorted((vm for vm in vms if _is_running(vm)), key=lambda vm: int(vm.instance_id))
    if not running:
        raise EvictionError(
            f"no running instance in scale set {scale_set} (instances: {present}); the pool "
            "scales to zero when nothing trains, so start the job first"
        )
    return running[0]


def kubectl_pod_node(pod: str, namespace: str) -> str:
    """The node a pod runs on, asked of the current kubectl context."""
    command = ["kubectl", "get", "pod", pod, "-n", namespace, "-o", "jsonpath={.spec.nodeName}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        raise EvictionError(
            f"--pod needs a working kubectl on PATH with the cluster's credentials "
            f"(`az aks get-credentials`), or pass --node or --instance-id ({err})"
        ) from err
    if done.returncode != 0:
        raise EvictionError(f"--pod {pod}: kubectl failed: {done.stderr.strip()}")
    if not done.stdout.strip():
        raise EvictionError(f"--pod {pod} in namespace {namespace} is not scheduled on a node yet")
    return done.stdout.strip()


def find_target(
    client: ComputeManagementClient, request: EvictionRequest, pod_resolver: PodResolver
) -> EvictionTarget:
    """Resolve the request to one VM of the pool's scale set (read-only calls)."""
    node = pod_resolver(request.pod, request.namespace) if request.pod else request.node
    wanted = request.instance_id
    node_scale_set = None
    if node is not None:
        node_scale_set, wanted = parse_node_name(node)
    rg = request.resource_group
    scale_set = pool_scale_set(list(client.virtual_machine_scale_sets.list(rg)), request.pool, rg)
    if node_scale_set is not None and node_scale_set != scale_set.name:
        raise EvictionError(
            f"node {node} belongs to scale set {node_scale_set}, not to pool {request.pool!r} "
            f"({scale_set.name}); only the GPU Spot pool's nodes can be evicted"
        )
    vms = list(client.virtual_machine_scale_set_vms.list(rg, scale_set.name, expand="instanceView"))
    vm = choose_instance(vms, wanted, scale_set.name)
    os_profile = vm.os_profile
    return EvictionTarget(
        resource_group=rg,
        scale_set=scale_set.name,
        instance_id=vm.instance_id,
        node=os_profile.computer_name if os_profile is not None else node,
    )


def explain_azure_error(err: HttpResponseError, request: EvictionRequest) -> str:
    """Turn an ARM error into a message that says what to fix."""
    code = err.error.code if err.error is not None else None
    said = err.error.message if err.error is not None and err.error.message else err.message
    if err.status_code == 403 or code == "AuthorizationFailed":
        return (
            f"Azure denied access ({code or err.status_code}): the signed-in identity needs "
            f"read on, and Spot eviction in, resource group {request.resource_group}, e.g. the "
            f"'Virtual Machine Contributor' role there. Azure said: {said}"
        )
    if code == "ResourceGroupNotFound":
        return (
            f"resource group {request.resource_group} not found in subscription "
            f"{request.subscription}; pass the cluster's node resource group (MC_...) "
            "via --node-resource-group or --stack-outputs"
        )
    return f"Azure refused ({code or err.status_code}): {said}"


@contextmanager
def azure_compute_client(subscription: str) -> Iterator[ComputeManagementClient]:
    """A compute client signed in as ``pulumi up`` deploys (lab/azure/clients.py): a service
    principal's ARM_* variables, or az login. Not DefaultAzureCredential: it would probe the
    instance metadata address and print every credential it tried."""
    with (
        credential_from_env(os.environ) as credential,
        ComputeManagementClient(credential, subscription) as client,
    ):
        yield client


def build_parser() -> argparse.ArgumentParser:
    """The ``simulate-eviction`` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m lab simulate-eviction",
        description=__doc__.split("\n\n")[1],
        epilog=(
            "Signs in as pulumi up deploys: ARM_CLIENT_ID/ARM_CLIENT_SECRET/ARM_TENANT_ID, or\n"
            "az login. Examples:\n"
            "  pulumi stack output --json --show-secrets > outputs.json\n"
            "  python -m lab simulate-eviction --stack-outputs outputs.json --dry-run\n"
            "  python -m lab simulate-eviction --stack-outputs outputs.json --pod JOB-worker-1"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_argument_group("where the pool is")
    where.add_argument(
        "--stack-outputs",
        type=Path,
        metavar="FILE",
        help=(
            "`pulumi stack output --json --show-secrets` as a file; its nodeResourceGroup and "
            "gpuPoolName are used"
        ),
    )
    where.add_argument("--subscription", help="subscription id (default: $AZURE_SUBSCRIPTION_ID)")
    where.add_argument(
        "--node-resource-group",
        metavar="RG",
        help="the cluster's node resource group (MC_...); beats the outputs",
    )
    where.add_argument(
        "--pool",
        help="AKS node pool to evict from (default: the outputs' gpuPoolName)",
    )
    which = parser.add_argument_group("which node (default: the running one with the lowest id)")
    pick = which.add_mutually_exclusive_group()
    pick.add_argument("--instance-id", help="VMSS instance id, e.g. 10")
    pick.add_argument(
        "--node", help="Kubernetes node name, e.g. aks-gpu1a2b3c4d-12345678-vmss00000a"
    )
    pick.add_argument("--pod", help="evict the node this pod runs on (asks kubectl)")
    which.add_argument(
        "-n",
        "--namespace",
        default=DEFAULT_NAMESPACE,
        help=f"namespace of --pod (default: {DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be evicted; change nothing"
    )
    return parser


def _run(request: EvictionRequest, client_factory: ClientFactory, resolver: PodResolver) -> None:
    with client_factory(request.subscription) as client:
        target = find_target(client, request, resolver)
        if request.dry_run:
            print(f"dry run: would evict {target.describe()}")
            return
        client.virtual_machine_scale_set_vms.simulate_eviction(
            target.resource_group, target.scale_set, target.instance_id
        )
    print(f"simulated eviction of {target.describe()}")
    print("its pods get SIGTERM on the Preempt notice; watch with `kubectl get pods -w`")


def main(
    argv: list[str] | None = None,
    *,
    client_factory: ClientFactory = azure_compute_client,
    pod_resolver: PodResolver = kubectl_pod_node,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run ``simulate-eviction``; returns 0 on success and 2 with a message on stderr if not."""
    args = build_parser().parse_args(argv)
    # azure-identity logs a failed sign-in as a warning; the one-line error below says it.
    logging.getLogger("azure.identity").setLevel(logging.ERROR)
    try:
        request = request_from_args(args, os.environ if environ is None else environ)
    except EvictionError as err:
        return _fail(str(err))
    try:
        _run(request, client_factory, pod_resolver)
    except EvictionError as err:
        return _fail(str(err))
    except ClientAuthenticationError as err:
        # The credential raises this when no sign-in works; ARM raises it on a 401.
        first_line = (err.message or str(err)).splitlines()[0]
        return _fail(
            "no usable Azure credentials: run `az login` with an account that can reach "
            f"subscription {request.subscription}, or set ARM_CLIENT_ID/ARM_TENANT_ID/"
            f"ARM_CLIENT_SECRET. Azure identity said: {first_line}"
        )
    except HttpResponseError as err:
        return _fail(explain_azure_error(err, request))
    except AzureError as err:  # a sign-in the lab cannot mirror (OIDC, no tenant)
        return _fail(str(err))
    return 0


def _fail(message: str) -> int:
    print(f"simulate-eviction: error: {message}", file=sys.stderr)
    return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
