"""The whole Pulumi program under mocks: what `pulumi up` would register, for every stack file."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pulumi
import pulumi_command
import pytest
import yaml
from pulumi.runtime.sync_await import _sync_await

from catalog.base_images import training_base_images
from catalog.deployer import AZURE_CLI_LOGIN, DeployerSignIn
from catalog.gpu_pools import MAX_GPU_NODES
from catalog.naming import global_names, lab_names, unique_suffix
from catalog.pool_labels import GENERATION_LABEL, GPU_SPOT, POOL_LABEL
from infra import cluster as aks_cluster
from infra import node_pools as aks
from infra.image import TrainingImage, TrainingImageArgs, build_command, image_tag, tree_digest
from infra.kubeconfig import deployer_kubeconfig
from infra.roles import (
    ACR_PULL,
    STORAGE_BLOB_DATA_CONTRIBUTOR,
    STORAGE_BLOB_DATA_READER,
    role_definition_id,
)
from stack_config import ConfigError, FallbackConfig, LabConfig, validate
from stack_config.files import stack_file_config
from tests.support.pulumi_harness import (
    PROJECT_DIR,
    SUBSCRIPTION_ID,
    AzureAnswers,
    ProgramRun,
    Registered,
    fake_uuid,
    run_program,
    run_pulumi,
)
from workloads.job import ConfigRefused

STACKS = ["dev", "a100"]
CLUSTER = "azure-native:containerservice:ManagedCluster"
AGENT_POOL = "azure-native:containerservice:AgentPool"
ROLE = "azure-native:authorization:RoleAssignment"
STORAGE_ACCOUNT = "azure-native:storage:StorageAccount"
REGISTRY = "azure-native:containerregistry:Registry"
IDENTITY = "azure-native:managedidentity:UserAssignedIdentity"
COMMAND = "command:local:Command"


@pytest.fixture(scope="module", params=STACKS)
def run(request: pytest.FixtureRequest) -> ProgramRun:
    return run_program(request.param)


def _kubelet(run: ProgramRun) -> dict[str, str]:
    return run.one(CLUSTER).outputs["identityProfile"]["kubeletidentity"]


def _role(run: ProgramRun, name: str) -> Registered:
    return run.one(ROLE, name_contains=name)


# ---- cluster ---------------------------------------------------------------------------------


def test_resource_group_is_named_for_the_stack(run: ProgramRun) -> None:
    rg = run.one("azure-native:resources:ResourceGroup")
    prefix = run.config["spot-lab:namePrefix"]
    assert rg.inputs["resourceGroupName"] == f"{prefix}-{run.stack}-rg"
    assert rg.inputs["location"] == "westus3"
    assert rg.inputs["resourceGroupName"] == run.outputs["resourceGroup"]
    assert rg.inputs["tags"]["project"] == "spot-lab"


def test_resource_group_sits_in_its_component_and_keeps_its_old_identity(
    run: ProgramRun,
) -> None:
    rg = run.one("azure-native:resources:ResourceGroup")
    component = run.one("spot-lab:resources:LabResourceGroup")
    assert rg.parent == component.urn
    assert component.parent_type == "pulumi:pulumi:Stack"
    # It was the top-level "lab": the alias keeps existing stacks from replacing it.
    assert ("lab", True) in rg.renamed_from
    everything_azure = [r for r in run.resources if r.type.startswith("azure-native:")]
    for resource in everything_azure:
        if resource is not rg and "resourceGroupName" in resource.inputs:
            assert resource.inputs["resourceGroupName"] == rg.outputs["name"], resource.name


def test_the_inline_pool_is_a_fixed_bootstrap_pool_for_aks_addons(run: ProgramRun) -> None:
    # AKS takes the first System pool only inline and can neither add to that list nor resize
    # it later: so it is fixed, small, and tainted for AKS's critical addons only.
    (bootstrap,) = run.one(CLUSTER).inputs["agentPoolProfiles"]
    assert bootstrap["mode"] == "System"
    assert bootstrap["vmSize"] == "Standard_D2s_v5" and bootstrap["count"] == 1
    assert bootstrap["nodeTaints"] == ["CriticalAddonsOnly=true:NoSchedule"]
    assert bootstrap["nodeLabels"] == {"spot-lab/pool": "bootstrap"}
    assert bootstrap["scaleSetPriority"] == "Regular"
    # No stack setting reaches it.
    other = run_program("dev", {"systemVmSize": "Standard_D8s_v5", "systemNodeCount": "3"})
    assert other.one(CLUSTER).inputs["agentPoolProfiles"] == [bootstrap]


def test_system_pool_is_a_separate_regular_cpu_pool(run: ProgramRun) -> None:
    system = run.one(AGENT_POOL, "cluster-system").inputs
    assert system["mode"] == "User"
    assert system["osType"] == "Linux"
    assert system["count"] == int(run.config["spot-lab:systemNodeCount"])
    assert system["scaleSetPriority"] == "Regular"
    assert system["vmSize"] == run.config["spot-lab:systemVmSize"]
    assert not system["vmSize"].startswith("Standard_N")
    assert system["nodeLabels"] == {"spot-lab/pool": "system"}
    assert "enableAutoScaling" not in system
    assert re.fullmatch(r"sys[0-9a-f]{8}", system["agentPoolName"])


def test_a_new_system_size_is_a_new_pool_not_a_new_cluster() -> None:
    before, after = run_program("dev"), run_program("dev", {"systemVmSize": "Standard_D4s_v5"})
    old, new = before.one(AGENT_POOL, "cluster-system"), after.one(AGENT_POOL, "cluster-system")
    assert old.urn == new.urn and old.inputs["agentPoolName"] != new.inputs["agentPoolName"]
    assert not new.delete_before_replace  # the new pool is up before the old one goes
    assert set(new.replace_on_changes) == {"vmSize", "scaleSetPriority", "osType", "type"}
    assert before.one(CLUSTER).inputs == after.one(CLUSTER).inputs
    # A node count is an in-place update of the same pool.
    more = run_program("dev", {"systemNodeCount": "3"}).one(AGENT_POOL, "cluster-system")
    assert more.inputs["agentPoolName"] == old.inputs["agentPoolName"]


def test_gpu_pool_is_a_separate_spot_agent_pool(run: ProgramRun) -> None:
    config = run.config
    pool = run.one(AGENT_POOL, "gpu-spot")
    assert pool.inputs["resourceName"] == run.one(CLUSTER).outputs["name"]
    assert pool.inputs["mode"] == "User"
    assert pool.inputs["osType"] == "Linux"
    assert pool.inputs["vmSize"] == config["spot-lab:gpuVmSize"]
    assert pool.inputs["scaleSetPriority"] == "Spot"
    assert pool.inputs["scaleSetEvictionPolicy"] == "Delete"
    assert pool.inputs["spotMaxPrice"] == -1
    assert pool.inputs["enableAutoScaling"] is True
    assert pool.inputs["minCount"] == int(config["spot-lab:gpuMinNodes"]) == 0
    # gpuMaxNodes is unset in the stack files: the pool follows the job's max workers.
    assert config["spot-lab:gpuMaxNodes"] == ""
    assert pool.inputs["maxCount"] == int(config["spot-lab:workerMaxReplicas"])
    # No pool of this name yet: it is created with gpuMinNodes nodes.
    assert pool.inputs["count"] == pool.inputs["minCount"]
    # Once created, the pool is never PUT again (infra.node_pools.AUTOSCALED_IGNORED): the
    # count is the autoscaler's, bounds and version go through `az aks nodepool`.
    assert pool.ignore_changes == ["count", "minCount", "maxCount", "orchestratorVersion"]
    assert pool.inputs["agentPoolName"] == run.outputs["gpuPoolName"]


def test_gpu_pool_taints_and_labels(run: ProgramRun) -> None:
    pool = run.one(AGENT_POOL, "gpu-spot").inputs
    assert pool["nodeTaints"] == [
        "kubernetes.azure.com/scalesetpriority=spot:NoSchedule",
        "nvidia.com/gpu=present:NoSchedule",
    ]
    # Each generation of the pool labels its nodes with its own name: the job selects it. And
    # AKS's own Spot label is declared: a pool update sends the whole label set, and one sent
    # without it deletes it from the pool's nodes (Azure/AKS #3152).
    assert pool["nodeLabels"] == {
        POOL_LABEL: GPU_SPOT,
        GENERATION_LABEL: pool["agentPoolName"],
        "kubernetes.azure.com/scalesetpriority": "spot",
    }
    ours = set(pool["nodeLabels"]) - {"kubernetes.azure.com/scalesetpriority"}
    for label in ours:
        assert not label.startswith(("kubernetes.azure.com/", "kubernetes.io/"))


def test_cluster_features(run: ProgramRun) -> None:
    cluster = run.one(CLUSTER).inputs
    # The managed Blob CSI driver: the dataset's read-only volume mounts through it.
    assert cluster["storageProfile"]["blobCSIDriver"] == {"enabled": True}
    assert cluster["oidcIssuerProfile"] == {"enabled": True}
    assert cluster["securityProfile"]["workloadIdentity"] == {"enabled": True}
    assert cluster["identity"] == {"type": "SystemAssigned"}
    assert cluster["enableRBAC"] is True
    network = cluster["networkProfile"]
    assert (network["networkPlugin"], network["networkPluginMode"]) == ("azure", "overlay")
    # AKS accepts the cilium policy engine only on the cilium dataplane.
    assert network["networkPolicy"] == network["networkDataplane"] == "cilium"
    assert cluster["autoScalerProfile"]["skipNodesWithLocalStorage"] == "false"
    assert "kubernetesVersion" not in cluster


@pytest.mark.parametrize("fallback", [None, FallbackConfig(max_nodes=2)])
def test_an_eviction_wave_does_not_halt_the_autoscaler(fallback: FallbackConfig | None) -> None:
    """Past ok-total-unready-count (and 45 % of the nodes) unready nodes, the autoscaler "stops
    all operations until the situation improves" (its FAQ, "How does CA deal with unready
    nodes?"): a wave that takes every Spot node at once must not stop the scale-up that
    replaces them. The most GPU nodes the config allows (stack_config refuses more), whatever
    this stack's ceilings: a new ceiling plans no cluster update
    (tests/infra/test_infra_gpu_pool.py)."""
    assert aks_cluster.autoscaler_profile(fallback)["ok_total_unready_count"] == "100"
    assert MAX_GPU_NODES == 100


def test_default_gpu_size_is_the_t4() -> None:
    assert LabConfig(project="spot-lab", stack="x").gpu_pool.vm_size == "Standard_NC4as_T4_v3"


def test_a100_stack_file_overrides_the_defaults() -> None:
    dev, a100 = run_program("dev"), run_program("a100")
    assert dev.one(AGENT_POOL, "gpu-spot").inputs["vmSize"] == "Standard_NC4as_T4_v3"
    assert a100.one(AGENT_POOL, "gpu-spot").inputs["vmSize"] == "Standard_NC24ads_A100_v4"
    assert (
        a100.one(AGENT_POOL, "gpu-spot").inputs["maxCount"]
        > dev.one(AGENT_POOL, "gpu-spot").inputs["maxCount"]
    )
    assert a100.one(AGENT_POOL, "cluster-system").inputs["vmSize"] == "Standard_D8s_v5"
    # A key the a100 file does not set keeps the Pulumi.yaml default.
    assert a100.config["spot-lab:spotMaxPrice"] == dev.config["spot-lab:spotMaxPrice"] == "-1"


# ---- storage, registry, identities -------------------------------------------------------------


def test_storage_account_is_private_https_tls12(run: ProgramRun) -> None:
    account = run.one(STORAGE_ACCOUNT).inputs
    assert account["kind"] == "StorageV2"
    assert account["enableHttpsTrafficOnly"] is True
    assert account["minimumTlsVersion"] == "TLS1_2"
    assert account["allowBlobPublicAccess"] is False
    assert re.fullmatch(r"[a-z0-9]{3,24}", account["accountName"])
    containers = run.of_type("azure-native:storage:BlobContainer")
    assert sorted(c.inputs["containerName"] for c in containers) == ["checkpoints", "data"]
    assert {c.inputs["publicAccess"] for c in containers} == {"None"}
    assert {c.inputs["accountName"] for c in containers} == {account["accountName"]}


def test_registry_has_no_admin_user_and_kubelet_can_pull(run: ProgramRun) -> None:
    registry = run.one(REGISTRY)
    assert registry.inputs["adminUserEnabled"] is False
    grant = _role(run, "acr-pull").inputs
    assert grant["principalId"] == _kubelet(run)["objectId"]
    assert grant["principalType"] == "ServicePrincipal"
    assert grant["scope"] == registry.id
    assert grant["roleDefinitionId"].endswith(f"/roleDefinitions/{ACR_PULL}")


def _container(run: ProgramRun, name: str) -> Registered:
    (container,) = [
        c
        for c in run.of_type("azure-native:storage:BlobContainer")
        if c.inputs["containerName"] == name
    ]
    return container


def test_the_kubelet_has_no_storage_role_and_nothing_is_account_wide(run: ProgramRun) -> None:
    """Any pod on a node can get the kubelet's token from the instance metadata service: it may
    pull images, and touch no blob."""
    kubelet = _kubelet(run)["objectId"]
    kubelet_roles = [r.inputs for r in run.of_type(ROLE) if r.inputs["principalId"] == kubelet]
    assert [r["roleDefinitionId"].rsplit("/", 1)[1] for r in kubelet_roles] == [ACR_PULL]
    account = run.one(STORAGE_ACCOUNT).id
    assert all(not r["scope"].startswith(account) for r in kubelet_roles)
    assert all(r.inputs["scope"] != account for r in run.of_type(ROLE))


def test_storage_accepts_entra_id_only(run: ProgramRun) -> None:
    spec = run.one(STORAGE_ACCOUNT).inputs
    # Unset means true: an account key would exist and sign anything.
    assert spec["allowSharedKeyAccess"] is False
    assert spec["defaultToOAuthAuthentication"] is True


def test_the_deployer_may_upload_the_data_without_a_key(run: ProgramRun) -> None:
    grant = _role(run, "deployer-data-writer").inputs
    assert grant["principalId"] == fake_uuid("deployer", "object")
    assert grant["principalType"] == "User"  # `az login`
    assert grant["scope"] == _container(run, "data").id
    assert grant["roleDefinitionId"].endswith(STORAGE_BLOB_DATA_CONTRIBUTOR)


def test_a_service_principal_deployer_is_granted_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # ARM refuses a role assignment whose principalType does not match the principal.
    monkeypatch.setenv("ARM_CLIENT_ID", "00000000-0000-0000-0000-00000000c1d0")
    monkeypatch.setenv("ARM_CLIENT_SECRET", "not-a-real-secret")
    answers = AzureAnswers(deployer_client_id="00000000-0000-0000-0000-00000000c1d0")
    grant = _role(run_program("dev", answers=answers), "deployer-data-writer").inputs
    assert grant["principalType"] == "ServicePrincipal"


def test_no_resource_and_no_kubernetes_object_references_an_account_key(run: ProgramRun) -> None:
    assert run.calls_to("azure-native:storage:listStorageAccountKeys") == []
    assert run.calls_to("azure-native:storage:listStorageAccountSAS") == []
    for resource in run.resources:
        text = json.dumps(resource.inputs, default=str).lower()
        for needle in (
            "accountkey",
            "account_key",
            "azurestorageaccountkey",
            "sharedaccesssignature",
        ):
            assert needle not in text, (resource.type, resource.name, needle)


@pytest.mark.parametrize(
    ("who", "account", "grants", "output"),
    [
        # The workers copy the dataset with their own identity and write checkpoints.
        (
            "training",
            "trainer",
            {("checkpoints", STORAGE_BLOB_DATA_CONTRIBUTOR), ("data", STORAGE_BLOB_DATA_READER)},
            "trainingClientId",
        ),
        # Only the staging Job's identity (and the deployer) writes the dataset.
        ("stager", "data-stager", {("data", STORAGE_BLOB_DATA_CONTRIBUTOR)}, "stagerClientId"),
    ],
)
def test_pod_identities_are_federated_and_write_one_container(
    run: ProgramRun, who: str, account: str, grants: set[tuple[str, str]], output: str
) -> None:
    identity = run.one(IDENTITY, f"{who}-identity")
    credential = run.one(
        "azure-native:managedidentity:FederatedIdentityCredential", f"{who}-identity"
    ).inputs
    issuer = run.one(CLUSTER).outputs["oidcIssuerProfile"]["issuerURL"]
    assert credential["issuer"] == issuer
    assert credential["subject"] == f"system:serviceaccount:spot-lab:{account}"
    assert credential["audiences"] == ["api://AzureADTokenExchange"]
    assert credential["resourceName"] == identity.outputs["name"]
    found = [r.inputs for r in run.of_type(ROLE) if r.name.startswith(f"{who}-identity")]
    ids = {c: _container(run, c).id for c in ("data", "checkpoints")}
    assert {
        (
            next(c for c, i in ids.items() if i == g["scope"]),
            g["roleDefinitionId"].rsplit("/", 1)[1],
        )
        for g in found
    } == grants
    assert len(found) == len(grants)
    for grant in found:
        assert grant["principalId"] == identity.outputs["principalId"]
        assert grant["principalType"] == "ServicePrincipal"
    assert run.outputs[output] == identity.outputs["clientId"]


# ---- image --------------------------------------------------------------------------------------


def test_image_is_built_in_the_registry_with_the_content_tag(run: ProgramRun) -> None:
    tag = image_tag(PROJECT_DIR / "training")
    build = run.one(COMMAND, "training-image-build")
    registry = run.one(REGISTRY).outputs
    # The registry's group and the stack's subscription, not az's lookup and default
    # (Azure/azure-cli #27913); amd64 whatever the laptop is.
    assert build.inputs["create"] == (
        f"az acr build --registry {registry['name']} --resource-group "
        f"{run.outputs['resourceGroup']} --subscription {SUBSCRIPTION_ID} "
        f"--platform linux/amd64 --image spot-lab-trainer:{tag} "
        f"--build-arg BASE_REGISTRY={registry['loginServer']} training"
    )
    assert build.inputs["triggers"] == [tag]
    # After the bases are in that registry: the build pulls nothing from Docker Hub.
    (imported,) = [r for r in run.of_type(COMMAND) if r.name.startswith("base-images-")]
    assert run.waits_for(build, imported)
    # No absolute path of this machine among the inputs: another checkout must not rebuild.
    assert "dir" not in build.inputs
    assert str(PROJECT_DIR) not in repr(build.inputs)
    assert run.outputs["image"] == f"{registry['loginServer']}/spot-lab-trainer:{tag}"


def test_docker_builder_builds_and_pushes_locally() -> None:
    run = run_program("dev", {"imageBuilder": "docker"})
    create = run.one(COMMAND, "training-image-build").inputs["create"]
    ref = run.outputs["image"]
    login_server = run.outputs["registryLoginServer"]
    assert create.endswith(
        f"docker build --platform linux/amd64 --tag {ref} "
        f"--build-arg BASE_REGISTRY={login_server} training && docker push {ref}"
    )
    assert create.startswith("az acr login --name ")
    assert f"--subscription {SUBSCRIPTION_ID}" in create


def test_the_bases_are_imported_into_the_lab_registry_by_digest(run: ProgramRun) -> None:
    """One import per base the Dockerfiles share (both build on the same slim Python), by its
    pinned digest, under the repository and tag their FROM names through BASE_REGISTRY."""
    (imported,) = [r for r in run.of_type(COMMAND) if r.name.startswith("base-images-")]
    registry = run.one(REGISTRY).outputs
    (base,) = {b for refs in training_base_images(PROJECT_DIR / "training").values() for b in refs}
    assert imported.inputs["create"] == (
        f"az acr import --name {registry['name']} --resource-group {run.outputs['resourceGroup']}"
        f" --subscription {SUBSCRIPTION_ID} --source docker.io/library/python@{base.digest}"
        f" --image library/python:{base.tag} --force"
    )
    assert imported.inputs["triggers"] == [base.digest]
    assert run.waits_for(run.one(COMMAND, "stager-image-build"), imported)


def test_image_ref_waits_for_the_build() -> None:
    images: list[TrainingImage] = []

    def program() -> None:
        args = TrainingImageArgs(
            "reg", "reg.azurecr.io", "rg", SUBSCRIPTION_ID, PROJECT_DIR, "training", "repo"
        )
        images.append(TrainingImage("img", args))

    run = run_pulumi(program)
    (build,) = run.of_type(COMMAND)
    dependencies = _sync_await(images[0].image_ref.resources())
    assert [r for r in dependencies if isinstance(r, pulumi_command.local.Command)]
    assert run.outputs == {}
    assert build.inputs["create"].startswith(
        f"az acr build --registry reg --resource-group rg --subscription {SUBSCRIPTION_ID} "
    )


def _copy_training(tmp_path: Path) -> Path:
    copy = tmp_path / "training"
    shutil.copytree(PROJECT_DIR / "training", copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_tag_is_stable_for_an_unchanged_tree(tmp_path: Path) -> None:
    copy = _copy_training(tmp_path)
    assert image_tag(copy) == image_tag(copy) == image_tag(PROJECT_DIR / "training")
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0cache")
    (copy / "stray.pyc").write_bytes(b"\0cache")
    assert image_tag(copy) == image_tag(PROJECT_DIR / "training")


@pytest.mark.parametrize("change", ["edit", "add", "rename"])
def test_tag_changes_with_content(tmp_path: Path, change: str) -> None:
    copy = _copy_training(tmp_path)
    before = image_tag(copy)
    if change == "edit":
        with open(copy / "Dockerfile", "a") as f:
            f.write("\n# changed\n")
    elif change == "add":
        (copy / "extra.py").write_text("X = 1\n")
    else:
        (copy / "Dockerfile").rename(copy / "Dockerfile.old")
    assert image_tag(copy) != before


def test_digest_frames_paths_and_bytes(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    (one / "a").write_text("xy")
    (one / "b").write_text("")
    (two / "a").write_text("x")
    (two / "b").write_text("y")
    assert tree_digest(one) != tree_digest(two)


def test_build_command_rejects_unknown_builder() -> None:
    with pytest.raises(ValueError, match="acr, docker"):
        build_command(
            "kaniko",
            registry_name="r",
            login_server="r.io",
            resource_group="g",
            subscription_id="s",
            repository="x",
            tag="t",
            context=".",
        )


# ---- outputs ------------------------------------------------------------------------------------


def test_stack_outputs(run: ProgramRun) -> None:
    cluster = run.one(CLUSTER).outputs
    assert run.outputs["clusterName"] == cluster["name"]
    assert run.outputs["nodeResourceGroup"] == cluster["nodeResourceGroup"]
    assert run.outputs["registryLoginServer"] == run.one(REGISTRY).outputs["loginServer"]
    assert run.outputs["storageAccount"] == run.one(STORAGE_ACCOUNT).outputs["name"]
    assert run.outputs["blobEndpoint"].startswith(f"https://{run.outputs['storageAccount']}.")
    assert run.outputs["dataContainer"] == "data"
    assert run.outputs["checkpointsContainer"] == "checkpoints"
    assert run.outputs["kubeletClientId"] == _kubelet(run)["clientId"]
    # A user's az login: kubelogin keeps the cluster's tenant (not az's default one).
    assert run.outputs["getCredentials"] == (
        f"az aks get-credentials --resource-group {run.outputs['resourceGroup']} "
        f"--name {cluster['name']} && kubelogin convert-kubeconfig --login azurecli "
        "--tenant-id 11111111-1111-1111-1111-111111111111"
    )
    assert {"namespace", "jobName", "rdzvId", "watchCommands"} <= set(run.outputs)


def test_the_stack_exports_no_credential_and_marks_the_kubeconfig_secret(
    run: ProgramRun,
) -> None:
    """Every secret the stack could hold, listed: only the kubeconfig is marked secret."""
    assert run.secret_outputs == {"kubeconfig"}
    credential_markers = ("accountkey", "sharedaccesssignature", "password", "client-key")
    for name, value in run.outputs.items():
        if name != "kubeconfig":
            text = json.dumps(value, default=str).lower()
            assert not any(m in text for m in credential_markers), name
    registry = run.one("azure-native:containerregistry:Registry").inputs
    assert registry["adminUserEnabled"] is False  # no registry password exists


def test_kubeconfig_is_a_secret_from_user_credentials(run: ProgramRun) -> None:
    assert "kubeconfig" in run.secret_outputs
    (call,) = run.calls_to("azure-native:containerservice:listManagedClusterUserCredentials")
    assert call.args["resourceName"] == run.outputs["clusterName"]
    assert call.args["resourceGroupName"] == run.outputs["resourceGroup"]
    assert call.args["format"] == "exec"  # the kubelogin plugin, not a certificate
    encoded = call.result["kubeconfigs"][0]["value"]
    as_user = DeployerSignIn(AZURE_CLI_LOGIN)
    text = base64.b64decode(encoded).decode()
    assert run.outputs["kubeconfig"] == deployer_kubeconfig(text, as_user, "User")
    assert yaml.safe_load(run.outputs["kubeconfig"])["kind"] == "Config"
    # The workloads' Kubernetes provider gets the same kubeconfig, still marked secret.
    provider = run.one("pulumi:providers:kubernetes")
    assert provider.inputs["kubeconfig"] == run.outputs["kubeconfig"]
    assert "kubeconfig" in provider.secret_inputs


@pytest.mark.parametrize("stack", ["dev", "a100"])
def test_kubernetes_provider_has_a_stable_cluster_identifier(stack: str) -> None:
    # pulumi-kubernetes replaces a provider whose kubeconfig is unknown at preview (the cluster
    # is updating) unless clusterIdentifier is set: then only a new identifier replaces it,
    # and etcd and the job are not shown as replaced by a mere config change.
    run = run_program(stack)
    provider = run.one("pulumi:providers:kubernetes")
    expected = f"{run.outputs['resourceGroup']}/{run.outputs['clusterName']}"
    assert provider.inputs["clusterIdentifier"] == expected
    # A plain string: the same before the cluster exists and after, whatever the kubeconfig.
    other = run_program(stack, {"workerMaxReplicas": "2", "workerReplicas": "1"})
    assert other.one("pulumi:providers:kubernetes").inputs["clusterIdentifier"] == expected


# ---- components -------------------------------------------------------------------------------


def test_every_resource_sits_in_a_component_named_for_it(run: ProgramRun) -> None:
    for resource in run.resources:
        if resource.parent_type == "pulumi:pulumi:Stack":
            # The stack holds components only: __main__.py composes, it creates nothing.
            assert not resource.custom, resource.name
            continue
        if resource.parent_type.startswith("spot-lab:"):
            assert resource.name.startswith(f"{resource.parent_name}-"), resource.name
    components = [r for r in run.resources if not r.custom and r.type.startswith("spot-lab:")]
    assert {c.type for c in components} >= {
        "spot-lab:resources:LabResourceGroup",
        "spot-lab:cluster:AksCluster",
        "spot-lab:storage:LabStorage",
        "spot-lab:registry:LabRegistry",
        "spot-lab:identity:WorkloadIdentity",
        "spot-lab:image:TrainingImage",
    }
    assert run.one(AGENT_POOL, "gpu-spot").parent_type == "spot-lab:cluster:AksCluster"


# ---- overrides and errors ---------------------------------------------------------------------


def test_overrides_reach_the_gpu_pool() -> None:
    run = run_program("dev", {"gpuMaxNodes": "5", "workerMaxReplicas": "5", "spotMaxPrice": "0.5"})
    pool = run.one(AGENT_POOL, "gpu-spot").inputs
    assert pool["maxCount"] == 5
    assert pool["spotMaxPrice"] == 0.5


def test_system_node_count_override_reaches_the_system_pool() -> None:
    run = run_program("dev", {"systemNodeCount": "3"})
    assert run.one(AGENT_POOL, "cluster-system").inputs["count"] == 3


def test_gpu_min_nodes_override_is_the_pools_floor_and_first_count() -> None:
    run = run_program("dev", {"gpuMinNodes": "1"})
    pool = run.one(AGENT_POOL, "gpu-spot")
    assert pool.inputs["minCount"] == 1
    # The count a new pool is created with; afterwards an update writes back the pool's own.
    assert pool.inputs["count"] == 1


def test_kubernetes_version_set_and_unset() -> None:
    pinned = run_program("dev", {"kubernetesVersion": "1.33"})
    assert pinned.one(CLUSTER).inputs["kubernetesVersion"] == "1.33"
    assert pinned.one(CLUSTER).inputs["agentPoolProfiles"][0]["orchestratorVersion"] == "1.33"
    assert pinned.one(AGENT_POOL, "gpu-spot").inputs["orchestratorVersion"] == "1.33"
    default = run_program("dev", {"kubernetesVersion": ""})
    assert "kubernetesVersion" not in default.one(CLUSTER).inputs
    assert "orchestratorVersion" not in default.one(AGENT_POOL, "gpu-spot").inputs


def test_azure_native_location_wins() -> None:
    run = run_program("dev", {"azure-native:location": "swedencentral"})
    assert run.one("azure-native:resources:ResourceGroup").inputs["location"] == "swedencentral"
    assert run.one(CLUSTER).inputs["location"] == "swedencentral"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"gpuMinNodes": "7"}, "spot-lab:gpuMinNodes"),
        ({"gpuMinNodes": "-1"}, "spot-lab:gpuMinNodes"),
        ({"gpuVmSize": "Standard_D8s_v5"}, "spot-lab:gpuVmSize"),
        ({"gpuVmSize": "Standard_NC6s_v3"}, "spot-lab:gpuVmSize"),
        ({"spotMaxPrice": "0"}, "spot-lab:spotMaxPrice"),
        ({"gpuMaxNodes": "2"}, "spot-lab:workerMaxReplicas"),
        ({"workerReplicas": "0"}, "spot-lab:workerReplicas"),
        ({"namePrefix": "Spot_Lab"}, "spot-lab:namePrefix"),
        ({"maxSteps": "lots"}, "spot-lab:maxSteps"),
        ({"runId": "Run 2"}, "spot-lab:runId"),
    ],
)
@pytest.mark.parametrize("stack", STACKS)
def test_config_errors_register_nothing(stack: str, overrides: dict[str, str], key: str) -> None:
    run = run_program(stack, overrides, check=False)
    # A RunError: the CLI prints its lines alone, no traceback.
    assert isinstance(run.error, ConfigRefused) and isinstance(run.error, pulumi.RunError)
    assert key in str(run.error)
    assert run.resources == []


def test_stack_files_use_only_declared_keys() -> None:
    for stack in STACKS:
        stack_file_config(stack)
    with pytest.raises(ConfigError, match="spot-lab:gpuMaxNode is not declared"):
        stack_file_config("dev", {"gpuMaxNode": "3"})


# ---- naming -------------------------------------------------------------------------------------


def test_global_names_are_stable_and_distinct_per_stack() -> None:
    dev, a100 = run_program("dev"), run_program("a100")
    again = run_program("dev", fresh=True)
    assert dev.outputs["storageAccount"] == again.outputs["storageAccount"]
    assert dev.outputs["storageAccount"] != a100.outputs["storageAccount"]
    assert dev.outputs["registryLoginServer"] != a100.outputs["registryLoginServer"]


OTHER_SUBSCRIPTION = "22222222-2222-2222-2222-222222222222"


def test_global_names_are_unique_per_subscription() -> None:
    """Two people deploying the same defaults into their own subscriptions do not collide."""
    mine = run_program("dev")
    theirs = run_program("dev", answers=AzureAnswers(subscription_id=OTHER_SUBSCRIPTION))
    again = run_program("dev", answers=AzureAnswers(subscription_id=OTHER_SUBSCRIPTION), fresh=True)
    for output in ("storageAccount", "registryLoginServer"):
        assert mine.outputs[output] != theirs.outputs[output]
        assert theirs.outputs[output] == again.outputs[output]
    (call,) = theirs.calls_to("azure-native:authorization:getClientConfig")
    assert call.result["subscriptionId"] == OTHER_SUBSCRIPTION
    suffix = unique_suffix(OTHER_SUBSCRIPTION, "spot-lab", "dev", "spotlab")
    assert theirs.outputs["storageAccount"] == f"spotlabst{suffix}"
    assert theirs.one(REGISTRY).inputs["registryName"] == f"spotlabcr{suffix}"


def test_name_suffix_depends_on_subscription_project_stack_and_prefix() -> None:
    base = unique_suffix(SUBSCRIPTION_ID, "spot-lab", "dev", "spotlab")
    assert base == unique_suffix(SUBSCRIPTION_ID.upper(), "spot-lab", "dev", "spotlab")
    others = {
        unique_suffix(OTHER_SUBSCRIPTION, "spot-lab", "dev", "spotlab"),
        unique_suffix(SUBSCRIPTION_ID, "other", "dev", "spotlab"),
        unique_suffix(SUBSCRIPTION_ID, "spot-lab", "prod", "spotlab"),
        unique_suffix(SUBSCRIPTION_ID, "spot-lab", "dev", "lab"),
    }
    assert base not in others and len(others) == 4
    with pytest.raises(ValueError, match="subscription_id must not be empty"):
        unique_suffix("", "spot-lab", "dev", "spotlab")


def test_longest_prefix_still_fits_azure_names() -> None:
    cfg = LabConfig(project="spot-lab", stack="My.Stack_1", name_prefix="a" * 12)
    names = lab_names(cfg)
    assert len(global_names(cfg, SUBSCRIPTION_ID).storage_account) <= 24
    assert names.cluster == f"{'a' * 12}-my-stack-1-aks"
    assert names.resource_group == f"{'a' * 12}-my-stack-1-rg"


@pytest.mark.parametrize("stack", ["a" * 22, "A.b_c-" * 3 + "dd"])
def test_names_of_the_longest_valid_stack_are_whole(stack: str) -> None:
    cfg = LabConfig(project="spot-lab", stack=stack)
    validate(cfg)
    names = lab_names(cfg)
    assert names.cluster.endswith("-aks") and len(names.cluster) <= 54
    assert re.fullmatch(r"[a-z0-9][-a-z0-9]*[a-z0-9]", names.cluster)
    node_rg = f"MC_{names.resource_group}_{names.cluster}_{cfg.location}"
    assert len(node_rg) <= 80


def test_a_too_long_stack_name_stops_the_program_before_any_resource(tmp_path: Path) -> None:
    stack = "experiment-with-a-long-name"
    shutil.copy(PROJECT_DIR / "Pulumi.dev.yaml", tmp_path / f"Pulumi.{stack}.yaml")
    run = run_program(stack, stack_dir=tmp_path, check=False)
    assert isinstance(run.error, ConfigRefused)
    assert f"stack name {stack!r} is too long" in str(run.error)
    assert run.resources == []


def test_built_in_role_ids_are_azures() -> None:
    # Copied from Azure's built-in roles reference, not from infra/roles.py: a wrong digit
    # makes every assignment fail with RoleDefinitionDoesNotExist at deploy time.
    assert ACR_PULL == "7f951dda-4ed3-4680-a7ca-43fe172d538d"
    assert STORAGE_BLOB_DATA_CONTRIBUTOR == "ba92f5b4-2d11-453d-a403-e96b0029c9fe"
    assert STORAGE_BLOB_DATA_READER == "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1"


def test_role_definition_id_takes_the_scopes_subscription() -> None:
    scope = "/subscriptions/abc/resourceGroups/rg/providers/Microsoft.Storage/storageAccounts/s"
    assert role_definition_id(scope, ACR_PULL) == (
        f"/subscriptions/abc/providers/Microsoft.Authorization/roleDefinitions/{ACR_PULL}"
    )
    with pytest.raises(ValueError, match="not an ARM id"):
        role_definition_id("rg/storage", ACR_PULL)


def test_pure_pool_specs_match_the_constants() -> None:
    cfg = LabConfig(project="spot-lab", stack="dev")
    spec = aks.gpu_spot_pool_spec(cfg.gpu_pool, cfg.gpu_max_nodes, None)
    assert aks.SPOT_TAINT in spec["node_taints"] and aks.GPU_TAINT in spec["node_taints"]
    assert spec["max_count"] == cfg.job.max_replicas
    assert spec["node_labels"] == {
        POOL_LABEL: GPU_SPOT,
        GENERATION_LABEL: spec["agent_pool_name"],
        **aks.SPOT_LABEL,
    }


# ---- create-only pool properties ---------------------------------------------------------------

# Each create-only setting the stack config reaches, with a second value (AKS refuses to change
# them in place: Manage node pools and Spot node pools, Limitations).
CREATE_ONLY_CHANGES = {
    "gpuVmSize": "Standard_NC8as_T4_v3",
    "spotMaxPrice": "0.5",
}


@pytest.mark.parametrize(("key", "value"), sorted(CREATE_ONLY_CHANGES.items()))
def test_a_create_only_change_names_a_new_gpu_pool(key: str, value: str) -> None:
    before = run_program("dev").one(AGENT_POOL, "gpu-spot")
    after = run_program("dev", {key: value}).one(AGENT_POOL, "gpu-spot")
    # Same logical resource, new physical name: Pulumi replaces it, creating the new pool first.
    assert after.urn == before.urn
    assert after.inputs["agentPoolName"] != before.inputs["agentPoolName"]
    assert after.delete_before_replace is False


@pytest.mark.parametrize(
    "override",
    [{"gpuMinNodes": "1"}, {"gpuMaxNodes": "5"}, {"workerMaxReplicas": "2", "workerReplicas": "1"}],
)
def test_count_changes_keep_the_gpu_pool(override: dict[str, str]) -> None:
    before = run_program("dev").one(AGENT_POOL, "gpu-spot")
    after = run_program("dev", override).one(AGENT_POOL, "gpu-spot")
    assert after.inputs["agentPoolName"] == before.inputs["agentPoolName"]
    assert after.inputs["minCount"] != before.inputs["minCount"] or (
        after.inputs["maxCount"] != before.inputs["maxCount"]
    )


def test_every_create_only_property_is_replaced_on_change(run: ProgramRun) -> None:
    pool = run.one(AGENT_POOL, "gpu-spot")
    assert set(pool.replace_on_changes) == {
        "vmSize",
        "scaleSetPriority",
        "scaleSetEvictionPolicy",
        "spotMaxPrice",
        "gpuProfile",
        "osType",
        "type",
    }
    # And each of them feeds the name, so the pool's identity follows it too.
    base = aks.gpu_spot_pool_spec(LabConfig(project="p", stack="s").gpu_pool, 3, None)
    changed = {
        "vm_size": "Standard_NC8as_T4_v3",
        "scale_set_priority": "Regular",
        "scale_set_eviction_policy": "Deallocate",
        "spot_max_price": 0.25,
        "gpu_profile": {"driver": "None"},
        "os_type": "Windows",
        "type": "AvailabilitySet",
    }
    assert set(changed) == set(aks.GPU_POOL_CREATE_ONLY)
    for key, value in changed.items():
        assert aks.gpu_pool_name({**base, key: value}) != base["agent_pool_name"], key
    name = base["agent_pool_name"]
    assert re.fullmatch(r"[a-z][a-z0-9]{0,11}", name), name  # AKS: Linux pool names


def test_dev_to_a100_replaces_the_gpu_pool_and_keeps_the_cluster() -> None:
    # The dev stack given the a100 stack file's values: "config overrides per environment".
    a100 = yaml.safe_load((PROJECT_DIR / "Pulumi.a100.yaml").read_text())["config"]
    # Not namePrefix: it names every resource, so it makes another lab, not a change.
    overrides = {
        # An object (trainArgs) as the CLI hands it over: JSON.
        key.split(":", 1)[1]: json.dumps(value) if isinstance(value, dict) else str(value)
        for key, value in a100.items()
        if key.startswith("spot-lab:") and key != "spot-lab:namePrefix"
    }
    dev, moved = run_program("dev"), run_program("dev", overrides)
    assert moved.one(AGENT_POOL, "gpu-spot").inputs["vmSize"] == "Standard_NC24ads_A100_v4"
    assert dev.one(AGENT_POOL, "gpu-spot").urn == moved.one(AGENT_POOL, "gpu-spot").urn
    assert (
        dev.one(AGENT_POOL, "gpu-spot").inputs["agentPoolName"]
        != (moved.one(AGENT_POOL, "gpu-spot").inputs["agentPoolName"])
    )
    assert dev.one(CLUSTER).urn == moved.one(CLUSTER).urn
    assert (
        dev.one(CLUSTER).inputs["agentPoolProfiles"]
        == moved.one(CLUSTER).inputs["agentPoolProfiles"]
    )
    # The job selects the new generation only, and follows the new pool (depends on it).
    for run in (dev, moved):
        pool = run.one(AGENT_POOL, "gpu-spot")
        job = run.one("kubernetes:kubeflow.org/v1:PyTorchJob")
        selector = job.inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        # The pool's own labels (AKS's Spot label beside them, declared for AKS's sake).
        labels = pool.inputs["nodeLabels"]
        assert selector["nodeSelector"] == {
            key: labels[key] for key in (POOL_LABEL, GENERATION_LABEL)
        }
        assert run.waits_for(job, pool)


# ---- the harness itself -------------------------------------------------------------------------


def test_harness_runs_are_independent() -> None:
    first = run_program("dev", {"gpuMaxNodes": "4"}, fresh=True)
    second = run_program("dev", fresh=True)
    assert first.one(AGENT_POOL, "gpu-spot").inputs["maxCount"] == 4
    assert second.one(AGENT_POOL, "gpu-spot").inputs["maxCount"] == 3
    assert len(first.resources) == len(second.resources)
    assert len({r.urn for r in second.resources}) == len(second.resources)
    assert second.config["spot-lab:gpuMaxNodes"] == ""


def test_harness_hands_each_caller_its_own_copy_of_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    first = run_program("dev")
    first.one(AGENT_POOL, "gpu-spot").inputs["maxCount"] = 99
    first.outputs.clear()
    again = run_program("dev")
    assert again.one(AGENT_POOL, "gpu-spot").inputs["maxCount"] == 3
    assert again.outputs["storageAccount"]
    # The deployer's sign-in is read from ARM_*: another environment is another run.
    monkeypatch.setenv("ARM_CLIENT_ID", "00000000-0000-0000-0000-00000000c1d0")
    monkeypatch.setenv("ARM_CLIENT_SECRET", "not-a-real-secret")
    as_principal = run_program("dev")
    assert _role(as_principal, "deployer-data-writer").inputs["principalType"] == "ServicePrincipal"
    assert _role(again, "deployer-data-writer").inputs["principalType"] == "User"


def test_harness_keeps_registrations_of_a_failing_program() -> None:
    import pulumi_azure_native as azure_native

    def program() -> None:
        azure_native.resources.ResourceGroup("rg", location="westus3")
        raise RuntimeError("boom")

    failed = run_pulumi(program, check=False)
    assert isinstance(failed.error, RuntimeError)
    assert [r.type for r in failed.resources] == ["azure-native:resources:ResourceGroup"]
    with pytest.raises(RuntimeError, match="boom"):
        run_pulumi(program)
