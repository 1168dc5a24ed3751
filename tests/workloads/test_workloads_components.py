"""``LabWorkloads`` under Pulumi mocks: what it registers, through which provider, in what order."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pulumi
import pytest

from stack_config import DataConfig, JobConfig, LabConfig
from tests.support.pulumi_harness import ProgramRun, Registered, run_pulumi
from workloads.lab_workloads import LabWorkloads, LabWorkloadsArgs
from workloads.manifests.operator import training_operator_source

IMAGE = "spotlabacr.azurecr.io/spot-lab-train:0123456789ab"
STAGER_IMAGE = "spotlabacr.azurecr.io/spot-lab-stager:0123456789ab"
BLOB_ENDPOINT = "https://spotlab1a2b3c.blob.core.windows.net/"
KUBELET_CLIENT_ID = "00000000-0000-0000-0000-0000000000aa"
TRAINING_CLIENT_ID = "00000000-0000-0000-0000-0000000000bb"
PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"
STATEFULSET = "kubernetes:apps/v1:StatefulSet"
PV = "kubernetes:core/v1:PersistentVolume"
PVC = "kubernetes:core/v1:PersistentVolumeClaim"
GPU_POOL = "gpu1a2b3c4d"


def _config(**job: Any) -> LabConfig:
    return LabConfig(project="spot-lab", stack="dev", job=JobConfig(**job))


def _run(config: LabConfig | None = None, image: str = IMAGE) -> ProgramRun:
    cfg = config or _config()

    def program() -> None:
        workloads = LabWorkloads(
            "lab",
            LabWorkloadsArgs(
                config=cfg,
                kubeconfig=pulumi.Output.secret("apiVersion: v1\nkind: Config\n"),
                image=pulumi.Output.from_input(image),
                stager_image=STAGER_IMAGE,
                storage_account="spotlab1a2b3c",
                storage_resource_group="spotlab-dev-rg",
                data_container="data",
                checkpoints_container="checkpoints",
                blob_endpoint=BLOB_ENDPOINT,
                training_client_id=TRAINING_CLIENT_ID,
                stager_client_id="stager-client-id",
                gpu_pool_name=GPU_POOL,
                cluster_identifier="spotlab-dev-rg/spotlab-dev-aks",
            ),
        )
        pulumi.export("namespace", workloads.namespace)
        pulumi.export("job_name", workloads.job_name)
        pulumi.export("watch_commands", workloads.watch_commands)

    return run_pulumi(program, {}, project="spot-lab", stack="dev")


@pytest.fixture(scope="module")
def default_run() -> ProgramRun:
    return _run()


def _name(urn: str) -> str:
    return urn.rsplit("::", 1)[-1]


def _job(run: ProgramRun) -> Registered:
    return run.one(PYTORCHJOB)


def _elastic(run: ProgramRun) -> dict[str, Any]:
    return _job(run).inputs["spec"]["elasticPolicy"]


def _worker_env(run: ProgramRun) -> dict[str, str]:
    worker = _job(run).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = worker["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def test_every_component_is_registered_under_lab_workloads(default_run: ProgramRun) -> None:
    root = default_run.one("spot-lab:workloads:LabWorkloads")
    children = {(r.type, r.name) for r in default_run.children_of(root)}
    assert children == {
        ("pulumi:providers:kubernetes", "lab-kubernetes"),
        ("spot-lab:workloads:LabNamespace", "lab-namespace"),
        ("kubernetes:scheduling.k8s.io/v1:PriorityClass", "lab-priority-training"),
        ("kubernetes:scheduling.k8s.io/v1:PriorityClass", "lab-priority-rendezvous"),
        ("kubernetes:kustomize/v2:Directory", "lab-operator-kustomize"),
        ("kubernetes:apps/v1:DaemonSet", "lab-device-plugin-daemonset"),
        ("spot-lab:workloads:Rendezvous", "lab-etcd"),
        ("spot-lab:workloads:NodeAgent", "lab-node-agent"),
        ("spot-lab:workloads:ElasticTrainingJob", "lab-job"),
        ("spot-lab:workloads:DataStaging", "lab-data-staging"),
        ("spot-lab:workloads:DatasetVolume", "lab-dataset"),
    }


def test_one_server_side_apply_provider_for_every_kubernetes_object(
    default_run: ProgramRun,
) -> None:
    provider = default_run.one("pulumi:providers:kubernetes")
    assert provider.inputs["enableServerSideApply"] in (True, "true")
    assert provider.inputs["kubeconfig"].startswith("apiVersion: v1")
    objects = [r for r in default_run.resources if r.type.startswith("kubernetes:")]
    # 17, the job's run record, the namespace-wide metadata policy, and the node agent's 7
    # (ServiceAccount, Role and binding, ClusterRole and binding, NetworkPolicy, DaemonSet).
    assert len(objects) == 26
    for obj in objects:
        assert obj.provider is not None, obj.name
        assert obj.provider.startswith(provider.urn), obj.name


def test_objects_are_named_after_their_component(default_run: ProgramRun) -> None:
    for obj in default_run.resources:
        if obj.type.startswith("kubernetes:"):
            assert obj.name.startswith(f"{obj.parent_name}-"), obj.name


def test_the_operator_is_the_pinned_kustomize_overlay(default_run: ProgramRun) -> None:
    overlay = default_run.one("kubernetes:kustomize/v2:Directory")
    assert overlay.inputs["directory"] == training_operator_source("v1.9.4")
    assert overlay.parent_name == "lab"


def test_job_waits_for_operator_etcd_volumes_and_namespace(default_run: ProgramRun) -> None:
    job = _job(default_run)
    waits_for = {_name(urn) for urn in job.dependencies}
    assert {
        "lab-operator-kustomize",
        "lab-etcd-statefulset",
        "lab-etcd-client",
        "lab-namespace-namespace",
        "lab-priority-training",
        "lab-dataset-pvc",
    } <= waits_for


def test_namespaced_objects_wait_for_the_namespace(default_run: ProgramRun) -> None:
    namespace = default_run.one("kubernetes:core/v1:Namespace")
    for obj in default_run.resources:
        namespaced = obj.type.startswith("kubernetes:") and isinstance(
            obj.inputs.get("metadata"), dict
        )
        if namespaced and obj.inputs["metadata"].get("namespace") == "spot-lab":
            assert namespace.urn in obj.dependencies, obj.name


def test_a_new_spec_replaces_the_job(default_run: ProgramRun) -> None:
    job = _job(default_run)
    assert job.replace_on_changes == ["spec"]
    assert job.delete_before_replace is True


def test_job_carries_the_image_and_the_rendezvous(default_run: ProgramRun) -> None:
    job = _job(default_run)
    (container,) = job.inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"
    ]
    assert container["image"] == IMAGE
    policy = _elastic(default_run)
    assert policy["rdzvBackend"] == "etcd"
    assert policy["rdzvHost"] == "etcd.spot-lab.svc.cluster.local"
    assert policy["rdzvPort"] == 2379
    assert job.inputs["metadata"]["name"] == "spotlab-train"


def test_min_and_max_replicas_flow_from_config_to_the_job(default_run: ProgramRun) -> None:
    run = _run(_config(min_replicas=2, max_replicas=5, replicas=4))
    policy = _elastic(run)
    assert (policy["minReplicas"], policy["maxReplicas"]) == (2, 5)
    worker = _job(run).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4
    assert policy["rdzvId"] != _elastic(default_run)["rdzvId"]


def test_hpa_metrics_flow_from_config_when_enabled(default_run: ProgramRun) -> None:
    assert "metrics" not in _elastic(default_run)
    (metric,) = _elastic(_run(_config(hpa_cpu_utilization=65)))["metrics"]
    assert metric["resource"]["target"]["averageUtilization"] == 65


def test_a_new_image_is_a_new_rendezvous(default_run: ProgramRun) -> None:
    other = _run(image=IMAGE.replace("0123456789ab", "fedcba987654"))
    assert _elastic(other)["rdzvId"] != _elastic(default_run)["rdzvId"]


def test_the_dataset_volume_is_keyless_read_only_and_bound_by_name(
    default_run: ProgramRun,
) -> None:
    pv, pvc = default_run.one(PV).inputs, default_run.one(PVC).inputs
    attributes = pv["spec"]["csi"]["volumeAttributes"]
    assert attributes["clientID"] == TRAINING_CLIENT_ID
    assert attributes["mountWithWorkloadIdentityToken"] == "true"
    assert (attributes["storageAccount"], attributes["containerName"]) == ("spotlab1a2b3c", "data")
    assert attributes["resourceGroup"] == "spotlab-dev-rg"
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["metadata"]["namespace"] == "spot-lab"
    # The job mounts exactly this claim.
    worker = _job(default_run).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    claims = [
        v["persistentVolumeClaim"]
        for v in worker["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == [{"claimName": pvc["metadata"]["name"], "readOnly": True}]


def test_the_workers_select_the_current_gpu_pool_generation(default_run: ProgramRun) -> None:
    worker = _job(default_run).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert worker["spec"]["nodeSelector"] == {
        "spot-lab/pool": "gpu-spot",
        "spot-lab/pool-generation": GPU_POOL,
    }


def test_destroy_finishes_when_the_cluster_is_gone(default_run: ProgramRun) -> None:
    """pulumi-kubernetes drops an unreachable cluster's objects from the state on delete only
    when the provider says so (provider.go, Delete: `if k.deleteUnreachable`); its default is
    false, and the provider's setting wins over PULUMI_K8S_DELETE_UNREACHABLE. Without it every
    object of a stopped or deleted cluster fails with "configured Kubernetes cluster is
    unreachable" and the destroy never completes. Objects a refresh drops that way are taken
    over again by the next up (upsertExistingObjects) instead of failing with AlreadyExists."""
    provider = default_run.one("pulumi:providers:kubernetes").inputs
    assert provider["deleteUnreachable"] in (True, "true")
    assert provider["upsertExistingObjects"] in (True, "true")
    assert provider["enableServerSideApply"] in (True, "true")


def test_service_account_is_bound_to_the_training_identity(default_run: ProgramRun) -> None:
    account = default_run.one("kubernetes:core/v1:ServiceAccount", "namespace")
    assert account.inputs["metadata"]["name"] == "trainer"
    assert account.inputs["metadata"]["annotations"] == {
        "azure.workload.identity/client-id": TRAINING_CLIENT_ID
    }


def test_data_through_the_volume_and_checkpoints_through_the_blob_api(
    default_run: ProgramRun,
) -> None:
    env = _worker_env(default_run)
    assert env["TRAIN_CHECKPOINT_URI"] == f"{BLOB_ENDPOINT}checkpoints/spotlab-train"
    assert env["TRAIN_DATA_URI"] == "/mnt/dataset"
    assert env["TRAIN_DATA_DIR"] == "/mnt/local/data"


def test_etcd_and_priority_classes_are_wired_together(default_run: ProgramRun) -> None:
    etcd = default_run.one(STATEFULSET).inputs["spec"]["template"]["spec"]
    classes = {
        r.inputs["metadata"]["name"]: r.inputs
        for r in default_run.of_type("kubernetes:scheduling.k8s.io/v1:PriorityClass")
    }
    assert etcd["priorityClassName"] == "spotlab-rendezvous"
    worker = _job(default_run).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["template"]["spec"]["priorityClassName"] == "spotlab-training"
    assert classes["spotlab-training"]["value"] < classes["spotlab-rendezvous"]["value"]
    assert classes["spotlab-training"]["preemptionPolicy"] == "Never"


def test_outputs_name_the_namespace_job_and_watch_commands(default_run: ProgramRun) -> None:
    assert default_run.outputs["namespace"] == "spot-lab"
    assert default_run.outputs["job_name"] == "spotlab-train"
    commands = default_run.outputs["watch_commands"]
    assert commands["jobs"] == "kubectl get pytorchjobs -n spot-lab"
    assert "training.kubeflow.org/job-name=spotlab-train" in commands["logs"]


def test_names_follow_the_config() -> None:
    run = _run(replace(_config(), name_prefix="lab2", namespace="exp"))
    assert run.outputs["job_name"] == "lab2-train"
    assert _elastic(run)["rdzvHost"] == "etcd.exp.svc.cluster.local"
    assert run.one(PYTORCHJOB).inputs["metadata"]["namespace"] == "exp"


# ---- data staging -------------------------------------------------------------------------------


def test_the_job_waits_for_the_staged_data(default_run: ProgramRun) -> None:
    staging = default_run.one("kubernetes:batch/v1:Job")
    job = default_run.one("kubernetes:kubeflow.org/v1:PyTorchJob")
    # pulumi-kubernetes creates the PyTorchJob only after the staging Job reports Complete.
    assert staging.urn in job.dependencies
    pod = staging.inputs["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "data-stager"
    assert pod["nodeSelector"] == {"spot-lab/pool": "system"}  # no GPU node for a download
    (container,) = pod["containers"]
    # The staging image, not the multi-GB CUDA training image, on the small CPU node.
    assert container["image"] == STAGER_IMAGE
    assert container["command"][:3] == ["python", "-m", "training.data.stage_data"]
    args = dict(zip(container["command"][3::2], container["command"][4::2], strict=True))
    assert args["--container-uri"] == f"{BLOB_ENDPOINT.rstrip('/')}/data"
    assert args["--checksum"] == "md5:c32a1d4ab5d03f1284b67883e8d87530"
    assert (
        staging.inputs["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"]
        == "true"
    )
    assert staging.custom_timeouts["create"] == "3600s"
    # A Job that failed is replaced by the next up (test_workloads_data_staging.py).
    assert staging.inputs["metadata"]["annotations"] == {"pulumi.com/replaceUnready": "true"}
    account = default_run.one("kubernetes:core/v1:ServiceAccount", "data-staging")
    assert account.inputs["metadata"]["annotations"] == {
        "azure.workload.identity/client-id": "stager-client-id"
    }


def test_no_staging_job_when_the_user_uploads() -> None:
    cfg = replace(_config(), data=DataConfig(source_url="none"))
    run = _run(cfg)
    assert run.of_type("kubernetes:batch/v1:Job") == []
    assert not [r for r in run.resources if r.type == "spot-lab:workloads:DataStaging"]


def test_a_new_source_is_a_new_staging_job() -> None:
    first = _run().one("kubernetes:batch/v1:Job").inputs["metadata"]["name"]
    cfg = replace(_config(), data=DataConfig(source_url="https://mirror.example/c.tgz"))
    second = _run(cfg).one("kubernetes:batch/v1:Job").inputs["metadata"]["name"]
    assert first != second
    assert first.startswith("spotlab-train-stage-") and second.startswith("spotlab-train-stage-")


# ---- what a pod with an identity may reach -----------------------------------------------------


def test_every_pod_with_an_azure_identity_is_kept_from_the_metadata_service(
    default_run: ProgramRun,
) -> None:
    policy = default_run.one("kubernetes:networking.k8s.io/v1:NetworkPolicy", "identity")
    spec = policy.inputs["spec"]
    assert policy.inputs["metadata"]["namespace"] == "spot-lab"
    selected = spec["podSelector"]["matchLabels"]
    templates = [
        _job(default_run).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"],
        default_run.one("kubernetes:batch/v1:Job").inputs["spec"]["template"],
    ]
    for template in templates:  # the workers and the staging Job
        assert selected.items() <= template["metadata"]["labels"].items()
        assert template["spec"]["serviceAccountName"] in ("trainer", "data-stager")
    assert spec["policyTypes"] == ["Egress"]
    blocks = [
        peer["ipBlock"] for rule in spec["egress"] for peer in rule["to"] if "ipBlock" in peer
    ]
    assert blocks == [{"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}]
