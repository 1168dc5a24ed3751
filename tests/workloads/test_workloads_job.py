"""The elastic PyTorchJob builder: specific paths, the v1.9.4 API, and the launch contract."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes.client
import kubernetes_validate
import pytest
from kubeflow.training import models as kubeflow_models
from kubeflow.training.api_client import ApiClient

from catalog.pool_labels import GENERATION_LABEL, POOL_LABEL
from stack_config import JobConfig, LabConfig
from tests.support.workload_specs import IMAGE, RDZV_HOST, _job_spec
from training.elastic.launch import (
    ETCD_BACKENDS,
    RDZV_PORT,
    RendezvousSettings,
    train_command,
    worker_env,
)
from training.loop.config import parse_config
from workloads.manifests.job import (
    DATASET_MOUNT,
    LOCAL_DATA_DIR,
    LOCAL_MOUNT,
    RUN_ID_LABEL,
    elastic_job_spec,
    elastic_policy,
    pytorchjob_manifest,
    rendezvous_id,
    training_args,
)
from workloads.manifests.run import blob_url
from workloads.manifests.scheduling import GPU_SPOT_POOL, SPOT_TOLERATION
from workloads.manifests.watch import watch_commands
from workloads.manifests.worker_program import WorkerProgram

K8S_VERSION = "1.33"


def _elastic(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["elasticPolicy"]


def _pod(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def _container(manifest: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod(manifest)["containers"]
    return container


def _env(manifest: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container(manifest)["env"]}


# ---- what the operator gets ------------------------------------------------------------------


def test_elastic_policy_is_etcd_on_the_rendezvous_service() -> None:
    policy = _elastic(pytorchjob_manifest(_job_spec()))
    assert policy["rdzvBackend"] == "etcd"
    assert policy["rdzvHost"] == RDZV_HOST
    assert policy["rdzvPort"] == RDZV_PORT == 2379
    assert (policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (1, 3, 100)
    assert "standalone" not in policy
    assert "nProcPerNode" not in policy


def test_rdzv_conf_is_the_shared_rendezvous_settings() -> None:
    settings = RendezvousSettings(last_call_timeout_s=2, keep_alive_interval_s=3)
    policy = _elastic(pytorchjob_manifest(_job_spec(rendezvous=settings)))
    assert policy["rdzvConf"] == [{"key": k, "value": v} for k, v in settings.conf().items()]
    assert {"key": "last_call_timeout", "value": "2"} in policy["rdzvConf"]


def test_the_workers_serve_the_operators_etcd_with_our_rendezvous_handler() -> None:
    # The operator knows c10d, etcd and etcd-v2; the warm agent (training/launcher.py) takes
    # etcd and registers training/elastic/rendezvous.py (etcd's v3 API) for it. The lab's
    # nodes run the same.
    manifest = pytorchjob_manifest(_job_spec())
    assert _elastic(manifest)["rdzvBackend"] in ETCD_BACKENDS
    assert _env(manifest)["TRAIN_LAUNCHER"] == "warm"
    assert _container(manifest)["command"][:3] == ["python", "-m", "training.agent"]
    # Defaults the stack's rendezvous keys give the handler: a 2 s TTL, a 1 s last call.
    conf = {c["key"]: c["value"] for c in _elastic(manifest)["rdzvConf"]}
    assert (conf["keep_alive_interval"], conf["keep_alive_max_attempt"]) == ("1", "5")


def test_operator_env_matches_what_the_lab_gives_its_agents() -> None:
    """Derive PET_* from the manifest as the operator does; it must equal ElasticPolicy's."""
    spec = _job_spec(min_replicas=2, max_replicas=4, replicas=3)
    manifest = pytorchjob_manifest(spec)
    policy = _elastic(manifest)
    from_manifest = {
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_RDZV_ENDPOINT": f"{policy['rdzvHost']}:{policy['rdzvPort']}",
        "PET_RDZV_ID": policy["rdzvId"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": manifest["spec"]["nprocPerNode"],
        "PET_RDZV_CONF": ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"]),
    }
    assert from_manifest == elastic_policy(spec).pet_env()


def test_the_agents_get_every_etcd_member_to_move_on_to() -> None:
    """The members the StatefulSet names reach the agent's client through the operator's
    PET_RDZV_CONF and torchrun's own parser (its pairs split on commas)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    from training.elastic.rendezvous import _client
    from workloads.manifests.etcd import EtcdSpec, etcd_member_endpoints

    members = etcd_member_endpoints(EtcdSpec(namespace="spot-lab", priority_class="p"))
    assert members[0] == "etcd-0.etcd-peers.spot-lab.svc.cluster.local:2379" and len(members) == 3
    env = elastic_policy(_job_spec(etcd_members=members)).pet_env()
    conf = _parse_rendezvous_config(env["PET_RDZV_CONF"])
    client = _client(RendezvousParameters("etcd", env["PET_RDZV_ENDPOINT"], "r", 1, 2, **conf))
    listed = [f"{host}:{port}" for host, port in client.members.endpoints]
    assert listed == [env["PET_RDZV_ENDPOINT"], *members]


def test_hpa_metrics_only_when_a_cpu_target_is_set() -> None:
    assert "metrics" not in _elastic(pytorchjob_manifest(_job_spec(hpa_cpu_utilization=0)))
    (metric,) = _elastic(pytorchjob_manifest(_job_spec(hpa_cpu_utilization=70)))["metrics"]
    assert metric["type"] == "Resource"
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}


def test_worker_replicas_retry_only_signals() -> None:
    manifest = pytorchjob_manifest(_job_spec(replicas=3))
    replica_specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert list(replica_specs) == ["Worker"]
    assert replica_specs["Worker"]["replicas"] == 3
    # OnFailure restarted a worker that exits 2 on missing data forever, on billed GPU nodes;
    # ExitCode fails the job on such a code and retries only signals (an eviction's SIGTERM).
    assert replica_specs["Worker"]["restartPolicy"] == "ExitCode"
    # No backoffLimit: under ExitCode it would count nothing (see run_policy).
    assert manifest["spec"]["runPolicy"] == {"cleanPodPolicy": "None"}
    assert manifest["spec"]["nprocPerNode"] == "1"
    assert manifest["apiVersion"] == "kubeflow.org/v1"
    assert manifest["kind"] == "PyTorchJob"


def test_active_deadline_is_optional() -> None:
    manifest = pytorchjob_manifest(_job_spec(active_deadline_s=7200))
    assert manifest["spec"]["runPolicy"] == {
        "cleanPodPolicy": "None",
        "activeDeadlineSeconds": 7200,
    }


# ---- rendezvous id ---------------------------------------------------------------------------


def test_rdzv_id_is_stable_for_an_unchanged_spec() -> None:
    assert rendezvous_id(_job_spec()) == rendezvous_id(_job_spec())
    assert _elastic(pytorchjob_manifest(_job_spec()))["rdzvId"] == rendezvous_id(_job_spec())


@pytest.mark.parametrize(
    "change",
    [
        {"image": IMAGE.replace("0123456789ab", "ba9876543210")},
        {"max_replicas": 5},
        {"max_steps": 30000},
        {"rendezvous": RendezvousSettings(join_timeout_s=60)},
        {"run_id": "2"},
        {"prefer_spot": True},
    ],
    ids=["image-tag", "max-replicas", "max-steps", "rendezvous", "run-id", "fallback"],
)
def test_rdzv_id_changes_with_the_image_or_the_spec(change: dict[str, Any]) -> None:
    before = rendezvous_id(_job_spec())
    after = rendezvous_id(_job_spec(**change))
    assert after != before
    assert after.startswith("spotlab-train-")


def test_without_the_fallback_a_job_keeps_the_id_it_had_before_the_fallback_existed() -> None:
    """The id hashed every field of the spec; ``prefer_spot``, trainArgs' fields,
    ``nccl_ib_env`` and ``etcd_members`` came later and are left out at their defaults, so
    turning nothing on replaces no running job."""
    spec = _job_spec()
    fields = dataclasses.asdict(spec)
    for added in ("prefer_spot", "program", "nccl_ib_env", "etcd_members"):
        del fields[added]
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    assert rendezvous_id(spec) == f"spotlab-train-1-{digest}"


def test_a_new_run_of_an_identical_job_gets_a_fresh_rendezvous() -> None:
    first, again, second = _job_spec(), _job_spec(), _job_spec(run_id="2")
    assert rendezvous_id(first) == rendezvous_id(again)
    assert rendezvous_id(first).startswith("spotlab-train-1-")
    assert rendezvous_id(second).startswith("spotlab-train-2-")
    manifest = pytorchjob_manifest(second)
    assert _elastic(manifest)["rdzvId"] == rendezvous_id(second)
    # Same job name and checkpoint location: the new run resumes from the old run's state.
    assert manifest["metadata"]["name"] == pytorchjob_manifest(first)["metadata"]["name"]
    assert _env(manifest) == _env(pytorchjob_manifest(first))
    template = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert manifest["metadata"]["labels"][RUN_ID_LABEL] == "2"
    assert template["metadata"]["labels"][RUN_ID_LABEL] == "2"


# ---- the worker container --------------------------------------------------------------------


def test_container_runs_torchrun_on_the_exact_image() -> None:
    spec = _job_spec()
    container = _container(pytorchjob_manifest(spec))
    assert container["name"] == "pytorch"
    assert container["image"] == IMAGE
    assert container["command"] == train_command(training_args(spec))
    assert container["command"][:5] == [
        "python",
        "-m",
        "training.agent",
        "--module",
        "training.train",
    ]
    assert not any(arg.startswith("--data-dir") for arg in container["command"])
    assert "--max-steps=20000" in container["command"]
    assert "--global-batch-size=256" in container["command"]
    assert "--checkpoint-every-steps=100" in container["command"]
    assert "--checkpoint-every-seconds=300" in container["command"]


def test_env_is_the_shared_worker_env() -> None:
    env = _env(pytorchjob_manifest(_job_spec(collective_timeout_s=45)))
    assert env == worker_env(
        checkpoint_uri="https://spotlabsa.blob.core.windows.net/checkpoints/spotlab-train",
        local_dir=LOCAL_MOUNT,
        collective_timeout_s=45,
    ) | {
        "TRAIN_DATA_URI": DATASET_MOUNT,
        "TRAIN_DATA_DIR": LOCAL_DATA_DIR,
    }
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_the_dataset_is_mounted_read_only_and_checkpoints_go_through_the_blob_api() -> None:
    endpoint = "https://spotlabsa.blob.core.windows.net/"
    uri = blob_url(endpoint, "checkpoints", "spotlab-train")
    assert uri == "https://spotlabsa.blob.core.windows.net/checkpoints/spotlab-train"
    manifest = pytorchjob_manifest(_job_spec(checkpoint_uri=uri))
    env = _env(manifest)
    assert env["TRAIN_CHECKPOINT_URI"] == uri
    (claim,) = [v for v in _pod(manifest)["volumes"] if "persistentVolumeClaim" in v]
    assert claim["persistentVolumeClaim"] == {"claimName": "spot-lab-dataset", "readOnly": True}
    (mount,) = [m for m in _container(manifest)["volumeMounts"] if m["name"] == claim["name"]]
    assert mount == {"name": claim["name"], "mountPath": DATASET_MOUNT, "readOnly": True}
    # The agent copies the data from the mount to the pod's local disk before it joins.
    assert env["TRAIN_DATA_URI"] == DATASET_MOUNT
    assert env["TRAIN_DATA_DIR"] == LOCAL_DATA_DIR and LOCAL_DATA_DIR.startswith(LOCAL_MOUNT)


def test_one_gpu_and_cpu_memory_requests() -> None:
    resources = _container(pytorchjob_manifest(_job_spec(worker_cpu="2500m")))["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert resources["requests"] == {"cpu": "2500m", "memory": "12Gi"}


def test_scheduled_on_the_gpu_spot_pool_as_preemptible_workload() -> None:
    pod = _pod(pytorchjob_manifest(_job_spec()))
    assert pod["nodeSelector"] == GPU_SPOT_POOL
    assert SPOT_TOLERATION in pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["priorityClassName"] == "spotlab-training"
    assert pod["serviceAccountName"] == "trainer"
    assert pod["terminationGracePeriodSeconds"] == 28


def test_a_worker_on_a_lost_node_is_replaced_after_30_s_not_300() -> None:
    """Without these, the DefaultTolerationSeconds admission plugin gives every pod 300 s on a
    not-ready or unreachable node before it is evicted (Kubernetes, Taints and Tolerations,
    "Taint based Evictions"): a worker on an evicted Spot VM would hold its replacement back
    for five minutes (Azure/AKS #3528)."""
    tolerations = _pod(pytorchjob_manifest(_job_spec()))["tolerations"]
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        assert {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 30,
        } in tolerations


@pytest.mark.parametrize(("grace", "deadline"), [(28, 25), (20, 17), (4, 1)])
def test_the_workers_deadline_sits_inside_the_pods_termination_grace(
    grace: int, deadline: int
) -> None:
    # One setting: the kubelet's SIGKILL comes at the grace; the save must be done (or given
    # up, the node-local copy kept) a few seconds before, with time for the agent to exit.
    manifest = pytorchjob_manifest(_job_spec(termination_grace_s=grace))
    assert _pod(manifest)["terminationGracePeriodSeconds"] == grace
    assert f"--stop-deadline-s={deadline}" in _container(manifest)["command"]
    flags = ["--data-dir=/d", "--checkpoint-uri=/c", f"--stop-deadline-s={deadline}"]
    assert parse_config(flags, env={}).checkpoint.stop_deadline_s == deadline  # accepted


def test_pods_use_workload_identity_and_carry_the_trainer_label() -> None:
    manifest = pytorchjob_manifest(_job_spec())
    labels = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
    assert labels["azure.workload.identity/use"] == "true"
    assert labels["spot-lab/role"] == "trainer"


def test_shared_memory_and_node_local_scratch() -> None:
    manifest = pytorchjob_manifest(_job_spec(shm_size="4Gi"))
    volumes = {v["name"]: v for v in _pod(manifest)["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert volumes["local"]["emptyDir"] == {}
    mounts = {m["name"]: m["mountPath"] for m in _container(manifest)["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    assert mounts["local"] == LOCAL_MOUNT == _env(manifest)["TRAIN_LOCAL_DIR"]


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"replicas": 4}, "replicas (4) must be within"),
        ({"min_replicas": 0, "replicas": 0}, "min_nodes must be >= 1"),
        ({"termination_grace_s": 30}, "termination_grace_s must be in 4..29"),
        ({"termination_grace_s": 3}, "termination_grace_s must be in 4..29"),
        ({"hpa_cpu_utilization": 101}, "hpa_cpu_utilization must be 0"),
        ({"image": "spotlabacr.azurecr.io/spot-lab-train"}, "image must carry an explicit tag"),
        ({"gpus_per_worker": 0}, "gpus_per_worker must be >= 1"),
    ],
)
def test_bad_specs_name_the_setting(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pytorchjob_manifest(_job_spec(**overrides))


def test_blob_url_rejects_plain_http_and_a_missing_container() -> None:
    with pytest.raises(ValueError, match="https:// blob_endpoint"):
        blob_url("http://x/", "c", "r")
    with pytest.raises(ValueError, match="https:// blob_endpoint"):
        blob_url("https://x/", "", "r")


# ---- from the stack config -------------------------------------------------------------------


def test_spec_from_stack_config() -> None:
    cfg = LabConfig(
        project="spot-lab",
        stack="dev",
        name_prefix="lab",
        job=JobConfig(
            min_replicas=2, max_replicas=5, replicas=7, run_id="3", termination_grace_s=20
        ),
    )
    spec = elastic_job_spec(
        cfg,
        image=IMAGE,
        rdzv_host=RDZV_HOST,
        priority_class="lab-training",
        data_claim="spot-lab-dataset",
        checkpoint_uri="https://a.blob.core.windows.net/checkpoints/lab-train",
        gpu_pool="gpu1a2b3c4d",
    )
    assert spec.name == "lab-train"
    # The workers select exactly this generation of the GPU pool.
    assert spec.node_selector == {POOL_LABEL: "gpu-spot", GENERATION_LABEL: "gpu1a2b3c4d"}
    # workerReplicas above the max starts the job at the max.
    assert (spec.min_replicas, spec.max_replicas, spec.replicas) == (2, 5, 5)
    assert spec.run_id == "3"
    assert spec.rendezvous == cfg.job.rendezvous
    assert spec.termination_grace_s == 20


def test_watch_commands_follow_the_job() -> None:
    commands = watch_commands("spot-lab", "spotlab-train", max_replicas=8)
    assert commands["jobs"] == "kubectl get pytorchjobs -n spot-lab"
    assert "-l training.kubeflow.org/job-name=spotlab-train" in commands["logs"]
    assert "--max-log-requests=8" in commands["logs"]
    assert commands["describe"] == "kubectl describe pytorchjob spotlab-train -n spot-lab"


# ---- the v1.9.4 API: nothing pruned ----------------------------------------------------------

# The generated SDK names the HPA metric type after its Go package; it is this client model.
MODEL_ALIASES = {"K8sIoApiAutoscalingV2MetricSpec": "V2MetricSpec"}
# The CRD's structural schema keeps only these keys of the pod template's metadata.
TEMPLATE_METADATA_KEYS = {"annotations", "finalizers", "labels", "name", "namespace"}
PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "object": (object,),
}


def _model(type_name: str) -> Any:
    name = MODEL_ALIASES.get(type_name, type_name)
    model = getattr(kubeflow_models, name, None) or getattr(kubernetes.client, name, None)
    if model is None:
        raise LookupError(f"no model {type_name}")
    return model


def unknown_fields(value: Any, type_name: str, path: str = "") -> list[str]:
    """Paths in ``value`` the typed models do not know (what the API server would prune)."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        inner = type_name[5:-1]
        return [p for i, v in enumerate(value) for p in unknown_fields(v, inner, f"{path}[{i}]")]
    if type_name.startswith("dict("):
        inner = type_name[5:-1].split(", ", 1)[1]
        return [p for k, v in value.items() for p in unknown_fields(v, inner, f"{path}.{k}")]
    if type_name in PRIMITIVES:
        wrong = isinstance(value, bool) and type_name == "int"
        return [] if isinstance(value, PRIMITIVES[type_name]) and not wrong else [f"{path}: type"]
    model = _model(type_name)
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    problems = [f"{path}.{k}" for k in value if k not in by_json]
    for key, item in value.items():
        if key in by_json:
            problems += unknown_fields(item, model.openapi_types[by_json[key]], f"{path}.{key}")
    return problems


def _manifests() -> list[dict[str, Any]]:
    blob_uri = "https://a.blob.core.windows.net/checkpoints/spotlab-train"
    return [
        pytorchjob_manifest(_job_spec()),
        pytorchjob_manifest(_job_spec(hpa_cpu_utilization=60)),
        pytorchjob_manifest(_job_spec(checkpoint_uri=blob_uri)),
        # runPolicy.activeDeadlineSeconds is a v1.9.4 field; a typo would be pruned silently.
        pytorchjob_manifest(_job_spec(active_deadline_s=3600)),
    ]


@pytest.mark.parametrize("manifest", _manifests(), ids=["mount", "hpa", "blob", "deadline"])
def test_no_field_would_be_pruned_by_the_v1_9_4_api(manifest: dict[str, Any]) -> None:
    assert unknown_fields(manifest, "KubeflowOrgV1PyTorchJob") == []
    template = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert set(template["metadata"]) <= TEMPLATE_METADATA_KEYS


def test_the_pruning_check_catches_a_typo() -> None:
    manifest = json.loads(json.dumps(pytorchjob_manifest(_job_spec(hpa_cpu_utilization=60))))
    manifest["spec"]["elasticPolicy"]["rdzvBakend"] = "etcd"
    manifest["spec"]["elasticPolicy"]["metrics"][0]["resource"]["targt"] = {}
    _pod(manifest)["containers"][0]["resources"]["limit"] = {}
    assert unknown_fields(manifest, "KubeflowOrgV1PyTorchJob") == [
        ".spec.elasticPolicy.rdzvBakend",
        ".spec.elasticPolicy.metrics[0].resource.targt",
        ".spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].resources.limit",
    ]


def test_round_trip_through_the_typed_pytorchjob_model() -> None:
    manifest = pytorchjob_manifest(_job_spec())

    class Response:
        data = json.dumps(manifest)

    client = ApiClient()
    job = client.deserialize(Response(), "KubeflowOrgV1PyTorchJob")
    assert isinstance(job, kubeflow_models.KubeflowOrgV1PyTorchJob)
    assert client.sanitize_for_serialization(job) == manifest


def test_worker_pod_and_hpa_metrics_validate_against_kubernetes() -> None:
    manifest = pytorchjob_manifest(_job_spec(hpa_cpu_utilization=60))
    template = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w", **template["metadata"]}}
    kubernetes_validate.validate({**pod, "spec": template["spec"]}, K8S_VERSION, strict=True)
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "h"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "j"},
            "maxReplicas": 3,
            "metrics": _elastic(manifest)["metrics"],
        },
    }
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)


def test_kubernetes_validation_rejects_a_broken_pod() -> None:
    template = pytorchjob_manifest(_job_spec())["spec"]["pytorchReplicaSpecs"]["Worker"]
    spec = json.loads(json.dumps(template["template"]["spec"]))
    spec["terminationGracePeriod"] = 25
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w"}, "spec": spec}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


ELASTIC_POLICY_SCHEMA = (
    Path(__file__).parents[1]
    / "recordings"
    / "kube"
    / "pytorchjob-v1.9.4-elastic-policy.schema.json"
)
OPERATOR_BACKENDS = ("c10d", "etcd", "etcd-v2")
"""training-operator v1.9.4's ``RDZVBackend`` constants (``pytorch_types.go``); its CRD types the
field as a plain string, and ``generateEnvBackend`` copies it into PET_RDZV_BACKEND as is."""


def test_the_elastic_policy_validates_against_the_v1_9_4_crd_schema() -> None:
    schema = json.loads(ELASTIC_POLICY_SCHEMA.read_text())
    for manifest in _manifests():
        jsonschema.validate(manifest["spec"]["elasticPolicy"], schema)
    policy = _elastic(pytorchjob_manifest(_job_spec()))
    assert schema["properties"]["rdzvBackend"]["type"] == "string"
    assert policy["rdzvBackend"] in OPERATOR_BACKENDS
    # The value the agent selects our handler from, and nothing torch's v2 backends would read.
    assert (policy["rdzvBackend"],) == ETCD_BACKENDS and "v2" not in policy["rdzvBackend"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**policy, "rdzvPort": "2379"}, schema)  # the check can fail


# ---- what the workers run: the loop with the stack's flags, or a plain script ----------------


def test_the_stack_flags_follow_the_jobs_own_and_change_the_rendezvous_id() -> None:
    plain = _job_spec()
    flagged = _job_spec(program=WorkerProgram(flags=("--lr=0.01", "--width=32")))
    command = _container(pytorchjob_manifest(flagged))["command"]
    assert command == train_command([*training_args(flagged), "--lr=0.01", "--width=32"])
    assert rendezvous_id(flagged) != rendezvous_id(plain)


def test_a_script_runs_under_the_agent_with_plain_torchrun() -> None:
    program = WorkerProgram(launcher="torchrun", script="train_ddp.py", flags=("--epochs=3",))
    manifest = pytorchjob_manifest(_job_spec(program=program))
    assert _container(manifest)["command"] == [
        "python",
        "-m",
        "training.agent",
        "train_ddp.py",
        "--epochs=3",
    ]
    assert _env(manifest)["TRAIN_LAUNCHER"] == "torchrun"
    # The same rendezvous as the loop's job: the operator's PET_* env from elasticPolicy.
    assert (
        _elastic(manifest)["rdzvBackend"]
        == _elastic(pytorchjob_manifest(_job_spec()))["rdzvBackend"]
    )


def test_a_data_prefix_is_a_folder_of_the_dataset_mount() -> None:
    manifest = pytorchjob_manifest(_job_spec(program=WorkerProgram(data_prefix="/points/v2/")))
    assert _env(manifest)["TRAIN_DATA_URI"] == "/mnt/dataset/points/v2"
    assert _env(pytorchjob_manifest(_job_spec()))["TRAIN_DATA_URI"] == "/mnt/dataset"
