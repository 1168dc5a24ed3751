"""The whole program under mocks: the workloads get the Azure side's outputs and fit its pools."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.pulumi_harness import PROJECT_DIR, ProgramRun, Registered, run_program
from workloads.manifests.scheduling import GPU_SPOT_POOL, SYSTEM_POOL

STACKS = ["dev", "a100"]
PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"
GPU_POOL = "azure-native:containerservice:AgentPool"
CLUSTER = "azure-native:containerservice:ManagedCluster"


@pytest.fixture(scope="module", params=STACKS)
def run(request: pytest.FixtureRequest) -> ProgramRun:
    return run_program(request.param)


def _pod_spec(resource: Registered) -> dict[str, Any]:
    spec = resource.inputs["spec"]
    if resource.type == PYTORCHJOB:
        return spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return spec["template"]["spec"]


def tolerated(taint: str, tolerations: list[dict[str, Any]]) -> bool:
    """Whether a node taint ``key[=value]:Effect`` is tolerated (Kubernetes' matching rules)."""
    key_value, effect = taint.rsplit(":", 1)
    key, _, value = key_value.partition("=")
    for t in tolerations:
        if t.get("effect") not in (None, "", effect):
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, "", key):
            return True
        if t.get("key") == key and t.get("operator", "Equal") == "Equal" and t["value"] == value:
            return True
    return False


def _system_pool(run: ProgramRun) -> dict[str, Any]:
    return run.one(GPU_POOL, "cluster-system").inputs


def test_only_aks_addons_run_on_the_bootstrap_pool(run: ProgramRun) -> None:
    # Our workloads select the CPU pool; none tolerates into the bootstrap pool by accident.
    (bootstrap,) = run.one(CLUSTER).inputs["agentPoolProfiles"]
    for workload in run.resources:
        if workload.type in ("kubernetes:apps/v1:StatefulSet", "kubernetes:batch/v1:Job"):
            pod = _pod_spec(workload)
            assert pod["nodeSelector"] == SYSTEM_POOL, workload.name
            assert not (pod["nodeSelector"].items() <= bootstrap["nodeLabels"].items())


def test_workers_fit_the_gpu_spot_pool(run: ProgramRun) -> None:
    pool = run.one(GPU_POOL, "gpu-spot").inputs
    daemonsets = run.of_type("kubernetes:apps/v1:DaemonSet")
    assert {d.name for d in daemonsets} == {
        "workloads-device-plugin-daemonset",
        "workloads-node-agent-daemonset",
    }
    for workload in (run.one(PYTORCHJOB), *daemonsets):
        pod = _pod_spec(workload)
        assert pod["nodeSelector"].items() <= pool["nodeLabels"].items()
        for taint in pool["nodeTaints"]:
            assert tolerated(taint, pod["tolerations"]), (workload.name, taint)
    assert GPU_SPOT_POOL.items() <= pool["nodeLabels"].items()


def test_etcd_fits_the_system_pool_and_not_the_spot_pool(run: ProgramRun) -> None:
    etcd = _pod_spec(run.one("kubernetes:apps/v1:StatefulSet"))
    system = _system_pool(run)
    assert etcd["nodeSelector"].items() <= system["nodeLabels"].items()
    assert SYSTEM_POOL.items() <= system["nodeLabels"].items()
    for taint in system.get("nodeTaints") or []:
        assert tolerated(taint, etcd["tolerations"]), taint
    spot_taints = run.one(GPU_POOL, "gpu-spot").inputs["nodeTaints"]
    assert not any(tolerated(t, etcd["tolerations"]) for t in spot_taints)


def test_workloads_use_the_azure_outputs(run: ProgramRun) -> None:
    job = _pod_spec(run.one(PYTORCHJOB))
    assert job["containers"][0]["image"] == run.outputs["image"]
    env = {e["name"]: e["value"] for e in job["containers"][0]["env"]}
    assert env["TRAIN_DATA_URI"] == "/mnt/dataset"
    # The dataset volume is the stack's data container, mounted as the training identity.
    pv = run.one("kubernetes:core/v1:PersistentVolume").inputs["spec"]["csi"]
    assert pv["volumeAttributes"]["storageAccount"] == run.outputs["storageAccount"]
    assert pv["volumeAttributes"]["containerName"] == run.outputs["dataContainer"]
    assert pv["volumeAttributes"]["resourceGroup"] == run.outputs["resourceGroup"]
    assert pv["volumeAttributes"]["clientID"] == run.outputs["trainingClientId"]
    account = run.one("kubernetes:core/v1:ServiceAccount", "namespace").inputs["metadata"]
    assert (
        account["annotations"]["azure.workload.identity/client-id"]
        == (run.outputs["trainingClientId"])
    )


def test_stack_exports_the_watch_commands(run: ProgramRun) -> None:
    job = run.outputs["jobName"]
    assert run.outputs["watchCommands"]["jobs"] == (
        f"kubectl get pytorchjobs -n {run.outputs['namespace']}"
    )
    assert f"training.kubeflow.org/job-name={job}" in run.outputs["watchCommands"]["logs"]


def test_config_overrides_reach_the_job() -> None:
    run = run_program(
        "dev",
        {
            "workerMinReplicas": "2",
            "workerMaxReplicas": "3",
            "workerReplicas": "3",
            "maxRestarts": "250",
            "hpaCpuUtilization": "55",
        },
    )
    job = run.one(PYTORCHJOB).inputs["spec"]
    policy = job["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (2, 3, 250)
    assert job["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert policy["metrics"][0]["resource"]["target"]["averageUtilization"] == 55
    env = {e["name"]: e["value"] for e in _pod_spec(run.one(PYTORCHJOB))["containers"][0]["env"]}
    assert env["TRAIN_CHECKPOINT_URI"] == (
        f"{run.outputs['blobEndpoint']}{run.outputs['checkpointsContainer']}/{run.outputs['jobName']}"
    )


def test_a_charlm_stack_stages_the_corpus_and_the_job_trains_the_task() -> None:
    run = run_program("dev", {"task": "charlm"})
    staging = run.one("kubernetes:batch/v1:Job").inputs["spec"]["template"]["spec"]
    command = staging["containers"][0]["command"]
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    assert flags["--source"].endswith("/data/tinyshakespeare/input.txt")
    assert flags["--checksum"] == (
        "sha256:86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    )
    assert flags["--format"] == "text"
    worker = _pod_spec(run.one(PYTORCHJOB))["containers"][0]
    assert "--task=charlm" in worker["command"]
    default = _pod_spec(run_program("dev").one(PYTORCHJOB))["containers"][0]
    assert "--task=cifar" in default["command"]


def test_the_stacks_precision_is_the_workers_flag() -> None:
    worker = _pod_spec(run_program("dev", {"precision": "bf16-mixed"}).one(PYTORCHJOB))
    assert "--precision=bf16-mixed" in worker["containers"][0]["command"]
    default = _pod_spec(run_program("dev").one(PYTORCHJOB))["containers"][0]
    assert "--precision=fp32" in default["command"]


def test_the_stacks_parallelism_is_the_workers_flag() -> None:
    run = run_program("dev", {"task": "charlm", "parallelism": "fsdp2"})
    assert "--parallelism=fsdp2" in _pod_spec(run.one(PYTORCHJOB))["containers"][0]["command"]
    default = _pod_spec(run_program("dev").one(PYTORCHJOB))["containers"][0]
    assert "--parallelism=ddp" in default["command"]


def test_run_id_gives_a_new_rendezvous_and_an_unchanged_config_keeps_it() -> None:
    first, again = run_program("dev"), run_program("dev", fresh=True)
    assert first.outputs["rdzvId"] == again.outputs["rdzvId"]
    rerun = run_program("dev", {"runId": "2"})
    assert rerun.outputs["rdzvId"] != first.outputs["rdzvId"]
    assert rerun.outputs["rdzvId"].startswith(f"{rerun.outputs['jobName']}-2-")
    job = rerun.one(PYTORCHJOB)
    assert job.inputs["spec"]["elasticPolicy"]["rdzvId"] == rerun.outputs["rdzvId"]
    assert job.inputs["metadata"]["labels"]["spot-lab/run-id"] == "2"
    # Same job and checkpoints; the new spec replaces the old job (delete first: same name).
    assert rerun.outputs["jobName"] == first.outputs["jobName"]
    assert job.replace_on_changes == ["spec"] and job.delete_before_replace


def operator_hpa(job: Registered) -> dict[str, Any]:
    """The HPA the training operator makes from a PyTorchJob's elasticPolicy.

    Mirrors desiredHPA in kubeflow/training-operator (pkg/controller.v1/pytorch/hpa.go):
    bounds and metrics are copied from elasticPolicy, the target is the job itself.
    """
    metadata, policy = job.inputs["metadata"], job.inputs["spec"]["elasticPolicy"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": metadata["name"], "namespace": metadata["namespace"]},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": job.inputs["apiVersion"],
                "kind": job.inputs["kind"],
                "name": metadata["name"],
            },
            "minReplicas": policy["minReplicas"],
            "maxReplicas": policy["maxReplicas"],
            "metrics": policy["metrics"],
        },
    }


def test_new_bounds_in_a_stack_file_reach_pool_job_and_hpa(tmp_path: Path) -> None:
    """Only the worker bounds change in the stack file; pool, job and HPA all follow."""
    stack_file = yaml.safe_load((PROJECT_DIR / "Pulumi.dev.yaml").read_text())
    values = stack_file["config"]
    assert "spot-lab:gpuMaxNodes" not in values and values["spot-lab:workerReplicas"] == "2"
    values["spot-lab:workerMinReplicas"] = "3"
    values["spot-lab:workerMaxReplicas"] = "5"
    values["spot-lab:hpaCpuUtilization"] = "70"
    (tmp_path / "Pulumi.dev.yaml").write_text(yaml.safe_dump(stack_file))

    run = run_program("dev", stack_dir=tmp_path)

    assert run.one(GPU_POOL, "gpu-spot").inputs["maxCount"] == 5
    job = run.one(PYTORCHJOB)
    policy = job.inputs["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"]) == (3, 5)
    # workerReplicas (2) is below the new minimum: the job starts with 3 workers.
    assert job.inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    hpa = operator_hpa(job)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 5)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"] == {
        "name": "cpu",
        "target": {"type": "Utilization", "averageUtilization": 70},
    }
    kubernetes_validate.validate(hpa, "1.33", strict=True)


def test_tolerated_follows_kubernetes_matching() -> None:
    spot = {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot"}
    assert tolerated("kubernetes.azure.com/scalesetpriority=spot:NoSchedule", [spot])
    assert not tolerated("kubernetes.azure.com/scalesetpriority=regular:NoSchedule", [spot])
    assert not tolerated("nvidia.com/gpu=present:NoSchedule", [spot])
    exists = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}
    assert not tolerated("nvidia.com/gpu=present:NoSchedule", [exists])


def test_destroy_deletes_every_object_before_its_pools_role_and_cluster(run: ProgramRun) -> None:
    """Pulumi deletes a resource before everything it depends on. Every Kubernetes object goes
    through the provider, which depends on the wait for the admin role and on both pools, so a
    destroy deletes the objects (and so drains etcd's pods, whose PodDisruptionBudget would
    stall a pool's drain) before the pools, the role and the cluster."""
    ends = [
        run.one(GPU_POOL, "gpu-spot"),
        run.one(GPU_POOL, "cluster-system"),
        run.one("azure-native:authorization:RoleAssignment", "deployer-cluster-admin"),
        run.one(CLUSTER),
    ]
    objects = [r for r in run.resources if r.type.startswith("kubernetes:")]
    assert len(objects) > 10
    for obj in objects:
        for end in ends:
            assert run.waits_for(obj, end), (obj.name, end.name)


def test_no_object_holds_a_finalizer_only_a_deleted_controller_could_clear(
    run: ProgramRun,
) -> None:
    """We set no finalizer. The ones Kubernetes adds (a PVC's and PV's protection, a Job's pod
    tracking, foreground deletion) are cleared by the control plane's own controllers, which
    live as long as the cluster. The one controller of ours, the training operator, serves the
    PyTorchJob: the job depends on it, so it is deleted while the operator still runs."""
    for obj in run.resources:
        metadata = obj.inputs.get("metadata")
        if obj.type.startswith("kubernetes:") and isinstance(metadata, dict):
            assert not metadata.get("finalizers"), obj.name
    job = run.one(PYTORCHJOB)
    operator = run.one("kubernetes:kustomize/v2:Directory")
    assert run.waits_for(job, operator)
