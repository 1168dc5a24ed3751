"""`pulumi up` for the Elastic Spot Training Lab: AKS with a GPU Spot pool, storage, a registry,
identities, the training image, and the elastic PyTorchJob on top.

This file only wires: config is read and validated once, then each component gets the
typed settings and the outputs of the components it depends on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pulumi

import stack_config
from catalog.deployer import DeployerSignIn, deployer_sign_in
from catalog.naming import GlobalNames, global_names, lab_names
from infra.cluster import AksCluster, AksClusterArgs
from infra.identity import WorkloadIdentity, WorkloadIdentityArgs
from infra.image import (
    BaseImages,
    BaseImagesArgs,
    TaskImage,
    TaskImageArgs,
    TrainingImage,
    TrainingImageArgs,
)
from infra.registry import LabRegistry, LabRegistryArgs
from infra.resource_group import LabResourceGroup, LabResourceGroupArgs
from infra.storage import LabStorage, LabStorageArgs
from stack_config.task_package import resolve
from workloads.job import ConfigRefused
from workloads.lab_workloads import LabWorkloads, LabWorkloadsArgs

PROJECT_DIR = Path(__file__).resolve().parent


# The provider settings that decide how azure-native signs in (catalog/deployer.py);
# secrets are read only to know whether they are set.
_SIGN_IN_SETTINGS = ("clientId", "tenantId", "useMsi", "useOidc")
_SIGN_IN_SECRETS = ("clientSecret", "clientCertificatePath")


def read_deployer() -> DeployerSignIn:
    """How ``pulumi up`` signs in to Azure: the cluster admin is that identity."""
    provider = pulumi.Config("azure-native")
    settings = {key: value for key in _SIGN_IN_SETTINGS if (value := provider.get(key))}
    settings |= {key: "set" for key in _SIGN_IN_SECRETS if provider.get_secret(key) is not None}
    return deployer_sign_in(os.environ, settings)


def read_config() -> stack_config.LabConfig:
    """The stack config, validated; the only place the program touches ``pulumi.Config``."""
    project = pulumi.get_project()
    config = pulumi.Config(project)
    raw = {key: value for key in stack_config.KEYS if (value := config.get(key)) is not None}
    location = pulumi.Config("azure-native").get("location")
    try:
        cfg = stack_config.load(raw, project, pulumi.get_stack(), location)
        stack_config.validate(cfg)
        # The task package and the task, read from disk (never run), with trainArgs.
        cfg, warnings = resolve(cfg, PROJECT_DIR)
    except stack_config.ConfigError as exc:  # one line per problem, no traceback
        raise ConfigRefused(exc.problems) from None
    for warning in warnings:
        pulumi.log.warn(warning)
    return cfg


@dataclass(frozen=True)
class AzureLab:
    """The Azure side of the stack, as the workloads and the stack outputs need it."""

    resource_group: LabResourceGroup
    cluster: AksCluster
    storage: LabStorage
    registry: LabRegistry
    training_identity: WorkloadIdentity
    stager_identity: WorkloadIdentity
    image: TrainingImage
    stager_image: TrainingImage
    """The data-staging Job's image: no CUDA, built from the same tree."""
    task_image: TaskImage | None
    """The training image plus the user's ``taskPackage``, when the stack names one."""
    deployer: DeployerSignIn
    deployer_type: pulumi.Output[str]
    """``User`` or ``ServicePrincipal``: what the deployer's object id is."""

    @property
    def worker_image(self) -> TrainingImage | TaskImage:
        """The image the training job runs."""
        return self.task_image or self.image


def deploy_azure(cfg: stack_config.LabConfig, deployer: DeployerSignIn) -> AzureLab:
    """Resource group, AKS, storage, registry, the training identity and the training image."""
    names = lab_names(cfg)
    tags = {"project": cfg.project, "stack": cfg.stack}
    resource_group = LabResourceGroup(
        "lab",
        LabResourceGroupArgs(
            names.resource_group, cfg.location, tags, retain_on_delete=cfg.retain_checkpoints
        ),
    )
    deployer_type = resource_group.deployer_client_id.apply(deployer.principal_type)
    cluster = AksCluster(
        "cluster",
        AksClusterArgs(
            resource_group_name=resource_group.name,
            cluster_name=names.cluster,
            location=cfg.location,
            cluster=cfg.cluster,
            gpu_pool=cfg.gpu_pool,
            gpu_max_nodes=cfg.gpu_max_nodes,
            fallback=cfg.fallback,
            admin_object_id=resource_group.deployer_object_id,
            admin_principal_type=deployer_type,
            deployer=deployer,
            tags=tags,
            subscription_id=resource_group.subscription_id,
        ),
    )
    storage, registry = deploy_stores(cfg, resource_group, cluster, deployer_type, tags)

    def pod_identity(
        who: str,
        identity_name: str,
        account: str,
        container_id: pulumi.Output[str],
        role: str,
        readable_container_id: pulumi.Output[str] | None = None,
    ) -> WorkloadIdentity:
        return WorkloadIdentity(
            f"{who}-identity",
            WorkloadIdentityArgs(
                resource_group_name=resource_group.name,
                identity_name=identity_name,
                location=cfg.location,
                oidc_issuer_url=cluster.oidc_issuer_url,
                namespace=cfg.namespace,
                service_account=account,
                writable_container_id=container_id,
                role_name=role,
                readable_container_id=readable_container_id,
                tags=tags,
            ),
        )

    training_identity = pod_identity(
        "training",
        names.training_identity,
        cfg.service_account,
        storage.checkpoints_container_id,
        "checkpoints-writer",
        # The dataset volume mounts with the workers' token for this identity (read-only).
        readable_container_id=storage.data_container_id,
    )
    # Only the staging Job writes the dataset; the training pods never can.
    stager_identity = pod_identity(
        "stager",
        names.stager_identity,
        cfg.stager_service_account,
        storage.data_container_id,
        "data-writer",
    )
    # The Dockerfiles' bases in the lab's registry first: no build pulls from Docker Hub.
    base_images = BaseImages(
        "base-images",
        BaseImagesArgs(
            registry_name=registry.name,
            resource_group=resource_group.name,
            subscription_id=resource_group.subscription_id,
            training_dir=PROJECT_DIR / "training",
        ),
    )
    image, stager_image = (
        TrainingImage(
            f"{who}-image",
            TrainingImageArgs(
                registry_name=registry.name,
                login_server=registry.login_server,
                resource_group=resource_group.name,
                subscription_id=resource_group.subscription_id,
                project_dir=PROJECT_DIR,
                context="training",
                repository=repository,
                builder=cfg.image_builder,
                dockerfile=dockerfile,
                base_images=base_images,
            ),
        )
        for who, repository, dockerfile in (
            ("training", names.image_repository, "Dockerfile"),
            ("stager", names.stager_image_repository, "Dockerfile.stager"),
        )
    )
    task_image = None
    if cfg.training.package_dir:
        task_image = TaskImage(
            "task-image",
            TaskImageArgs(
                base=image,
                registry_name=registry.name,
                login_server=registry.login_server,
                resource_group=resource_group.name,
                subscription_id=resource_group.subscription_id,
                project_dir=PROJECT_DIR,
                package_dir=Path(cfg.training.package_dir),
                repository=names.task_image_repository,
                builder=cfg.image_builder,
            ),
        )
    return AzureLab(
        resource_group,
        cluster,
        storage,
        registry,
        training_identity,
        stager_identity,
        image,
        stager_image,
        task_image,
        deployer,
        deployer_type,
    )


def deploy_stores(
    cfg: stack_config.LabConfig,
    resource_group: LabResourceGroup,
    cluster: AksCluster,
    deployer_type: pulumi.Output[str],
    tags: dict[str, str],
) -> tuple[LabStorage, LabRegistry]:
    """Storage and registry, named uniquely for the subscription; the kubelet pulls images."""
    unique: pulumi.Output[GlobalNames] = resource_group.subscription_id.apply(
        lambda subscription_id: global_names(cfg, subscription_id)
    )
    rg, kubelet = resource_group.name, cluster.kubelet_object_id
    storage = LabStorage(
        "storage",
        LabStorageArgs(
            rg,
            unique.apply(lambda n: n.storage_account),
            cfg.location,
            resource_group.deployer_object_id,
            deployer_type,
            tags,
            retain_on_delete=cfg.retain_checkpoints,
        ),
    )
    registry = LabRegistry(
        "registry",
        LabRegistryArgs(rg, unique.apply(lambda n: n.registry), cfg.location, kubelet, tags),
    )
    return storage, registry


def export_azure(azure: AzureLab) -> None:
    """Stack outputs: where everything is, and how to reach the cluster."""
    rg, cluster = azure.resource_group.name, azure.cluster
    pulumi.export("resourceGroup", rg)
    pulumi.export("clusterName", cluster.name)
    pulumi.export("nodeResourceGroup", cluster.node_resource_group)
    pulumi.export("gpuPoolName", cluster.gpu_pool_name)
    if cluster.on_demand_pool_name is not None:
        pulumi.export("onDemandPoolName", cluster.on_demand_pool_name)
    pulumi.export("kubeconfig", cluster.kubeconfig)
    pulumi.export("registryLoginServer", azure.registry.login_server)
    pulumi.export("storageAccount", azure.storage.account_name)
    pulumi.export("dataContainer", azure.storage.data_container)
    pulumi.export("checkpointsContainer", azure.storage.checkpoints_container)
    pulumi.export("blobEndpoint", azure.storage.blob_endpoint)
    pulumi.export("image", azure.worker_image.image_ref)
    pulumi.export("imageTag", azure.worker_image.tag)
    pulumi.export("trainingImage", azure.image.image_ref)
    pulumi.export("stagerImage", azure.stager_image.image_ref)
    pulumi.export("trainingClientId", azure.training_identity.client_id)
    pulumi.export("stagerClientId", azure.stager_identity.client_id)
    pulumi.export("kubeletClientId", cluster.kubelet_client_id)
    # Entra ID sign-in: the kubeconfig runs kubelogin as the identity that is cluster admin.
    pulumi.export(
        "getCredentials",
        pulumi.Output.all(
            rg, cluster.name, azure.resource_group.tenant_id, azure.deployer_type
        ).apply(lambda v: get_credentials_command(v[0], v[1], v[2], azure.deployer, v[3])),
    )


def get_credentials_command(
    resource_group: str, cluster: str, tenant_id: str, deployer: DeployerSignIn, kind: str
) -> str:
    """``az aks get-credentials`` and the kubelogin conversion that signs in as the deployer,
    keeping the cluster's tenant where kubelogin can use it."""
    flags = " ".join(deployer.login_flags(tenant_id, kind))
    return (
        f"az aks get-credentials --resource-group {resource_group} --name {cluster} "
        f"&& kubelogin convert-kubeconfig {flags}"
    )


def cluster_identifier(cfg: stack_config.LabConfig) -> str:
    """The cluster's resource group and name: stable for the stack, known before any apply."""
    names = lab_names(cfg)
    return f"{names.resource_group}/{names.cluster}"


# ---- Kubernetes workloads: etcd, device plugin, training operator, the elastic job ----------
def deploy_workloads(cfg: stack_config.LabConfig, azure: AzureLab) -> None:
    """Everything inside the cluster, and the commands to watch the job."""
    cluster, storage = azure.cluster, azure.storage
    workloads = LabWorkloads(
        "workloads",
        LabWorkloadsArgs(
            config=cfg,
            kubeconfig=cluster.kubeconfig,
            image=azure.worker_image.image_ref,
            stager_image=azure.stager_image.image_ref,
            storage_account=storage.account_name,
            storage_resource_group=storage.resource_group_name,
            data_container=storage.data_container,
            checkpoints_container=storage.checkpoints_container,
            blob_endpoint=storage.blob_endpoint,
            training_client_id=azure.training_identity.client_id,
            stager_client_id=azure.stager_identity.client_id,
            gpu_pool_name=cluster.gpu_pool_name,
            cluster_identifier=cluster_identifier(cfg),
            # Created after, and on destroy deleted before, the pools, the role and the cluster.
            access=[cluster.admin_ready, *cluster.node_pools],
        ),
    )
    pulumi.export("namespace", workloads.namespace)
    pulumi.export("jobName", workloads.job_name)
    pulumi.export("rdzvId", workloads.rdzv_id)
    pulumi.export("watchCommands", workloads.watch_commands)
    pulumi.export("checkpointUri", workloads.checkpoint_uri)
    prefix = cfg.data.prefix.strip("/")
    pulumi.export(
        "dataUri",
        pulumi.Output.all(storage.blob_endpoint, storage.data_container).apply(
            lambda v: "/".join(p for p in (v[0].rstrip("/"), v[1], prefix) if p)
        ),
    )
    if cfg.retain_checkpoints:
        # `pulumi destroy` runs no program, but shows the outputs it removes: this one says
        # what stays in Azure and how to take the weights out and delete it.
        pulumi.export(
            "keptOnDestroy",
            pulumi.Output.all(
                azure.resource_group.name, storage.account_name, workloads.checkpoint_uri
            ).apply(lambda v: kept_on_destroy(*v)),
        )


def kept_on_destroy(resource_group: str, account: str, checkpoint_uri: str) -> str:
    """What ``pulumi destroy`` leaves in Azure with ``retainCheckpoints``, and what to do.

    Retained resources leave the state but stay in Azure (Pulumi's ``retainOnDelete`` docs: the
    provider's Delete is not called); pulumi-azure-native then refuses to create one of the
    same id ("cannot create already existing resource", its existence check since PR #303),
    hence the last sentence."""
    return (
        f"pulumi destroy keeps resource group {resource_group} with storage account {account} "
        f"and the checkpoints at {checkpoint_uri}. Export the weights: python -m lab export "
        f"--checkpoint-uri {checkpoint_uri} --out model.pt. Delete them: az group delete "
        f"--name {resource_group} --yes (a new pulumi up of this stack needs them gone: it "
        "does not create over an existing resource)"
    )


def main() -> None:
    """Read config, stand up Azure, then the workloads on the cluster."""
    cfg = read_config()
    azure = deploy_azure(cfg, read_deployer())
    export_azure(azure)
    deploy_workloads(cfg, azure)


main()
