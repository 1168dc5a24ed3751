"""stack_config: loading raw config into LabConfig and validating it. Pure: no Pulumi runtime."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import stack_config
from catalog import gpu_sizes, naming
from stack_config import ConfigError, LabConfig, load, validate
from tests.support.stack_configs import _cfg, _problems

PROJECT_DIR = Path(__file__).resolve().parent.parent.parent


# ---- the key table and Pulumi.yaml agree -------------------------------------------------------


def _declared() -> dict[str, dict]:
    return yaml.safe_load((PROJECT_DIR / "Pulumi.yaml").read_text())["config"]


def test_every_setting_is_declared_in_pulumi_yaml_and_nothing_else() -> None:
    assert set(_declared()) == set(stack_config.KEYS)


def test_pulumi_yaml_declares_type_default_and_description() -> None:
    objects = {s.key for s in stack_config.SETTINGS if s.kind is dict}
    for key, spec in _declared().items():
        assert spec["description"].strip(), key
        if key in objects:
            # Pulumi.yaml has no object type: an object's default is a `value:` without one.
            assert "type" not in spec and spec["value"] == {}, key
            continue
        assert spec["type"] in ("string", "integer", "boolean"), key
        assert "default" in spec, key


def _yaml_string(value: object) -> str:
    """A Pulumi.yaml default the way the CLI hands it to the program."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, dict) else str(value)


def test_pulumi_yaml_defaults_equal_dataclass_defaults() -> None:
    raw = {
        key: _yaml_string(spec["default"] if "default" in spec else spec["value"])
        for key, spec in _declared().items()
    }
    assert load(raw, "spot-lab", "dev") == LabConfig(project="spot-lab", stack="dev")


def test_integer_keys_are_declared_as_integers() -> None:
    declared = _declared()
    kinds = {bool: "boolean", dict: None}
    for setting in stack_config.SETTINGS:
        # An optional integer is a string that may be empty: Pulumi requires a typed key
        # without a default, and "" is not an integer.
        expected = "integer" if setting.kind is int and not setting.optional else "string"
        expected = kinds.get(setting.kind, expected)
        assert declared[setting.key].get("type") == expected, setting.key
    assert declared["gpuMaxNodes"]["default"] == ""
    assert "default: workerMaxReplicas" in declared["gpuMaxNodes"]["description"]


# ---- load ---------------------------------------------------------------------------------------


def test_load_parses_every_section() -> None:
    cfg = load(
        {
            "gpuMaxNodes": "5",
            "workerMaxReplicas": "5",
            "spotMaxPrice": "0.5",
            "kubernetesVersion": "1.33",
            "rdzvJoinTimeout": "60",
            "systemNodeCount": " 3 ",
        },
        "spot-lab",
        "dev",
    )
    assert cfg.gpu_pool.max_nodes == 5
    assert cfg.job.max_replicas == 5
    assert cfg.gpu_pool.spot_max_price == 0.5
    assert cfg.cluster.kubernetes_version == "1.33"
    assert cfg.job.rendezvous.join_timeout_s == 60
    assert cfg.cluster.system_node_count == 3


def test_empty_kubernetes_version_means_aks_default() -> None:
    assert load({"kubernetesVersion": ""}, "spot-lab", "dev").cluster.kubernetes_version is None


def test_azure_native_location_wins_over_project_location() -> None:
    assert load({"location": "eastus"}, "p", "s", "westeurope").location == "westeurope"
    assert load({"location": "eastus"}, "p", "s", None).location == "eastus"
    assert load({}, "p", "s", None).location == "westus3"


@pytest.mark.parametrize("value", ["2.5", "three", "", "1e3"])
def test_non_integer_integer_names_the_key(value: str) -> None:
    message = _problems({"gpuMinNodes": value})
    assert "spot-lab:gpuMinNodes must be an integer" in message
    assert repr(value) in message


@pytest.mark.parametrize("value", ["2.5", "three", "1e3"])
def test_optional_integer_is_empty_or_an_integer(value: str) -> None:
    assert "spot-lab:gpuMaxNodes must be an integer" in _problems({"gpuMaxNodes": value})
    assert load({"gpuMaxNodes": " "}, "spot-lab", "dev").gpu_pool.max_nodes is None
    assert load({"gpuMaxNodes": "4"}, "spot-lab", "dev").gpu_pool.max_nodes == 4


def test_gpu_pool_follows_the_job_unless_gpu_max_nodes_is_set() -> None:
    assert _cfg().gpu_max_nodes == 3
    assert _cfg({"workerMaxReplicas": "5"}).gpu_max_nodes == 5
    assert _cfg({"workerMaxReplicas": "5", "gpuMaxNodes": "8"}).gpu_max_nodes == 8


def test_gpu_min_above_the_ceiling_that_follows_the_job() -> None:
    message = _problems({"gpuMinNodes": "4"})
    assert (
        "spot-lab:gpuMinNodes (4) must be <= spot-lab:workerMaxReplicas (3; "
        "spot-lab:gpuMaxNodes is unset)"
    ) in message


def test_unknown_key_is_rejected_with_the_known_keys() -> None:
    message = _problems({"gpuMaxNode": "3"})
    assert "spot-lab:gpuMaxNode is not a setting" in message
    assert "gpuMaxNodes" in message


def test_load_reports_all_parse_problems_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load({"gpuMaxNodes": "x", "maxSteps": "y"}, "spot-lab", "dev")
    assert len(info.value.problems) == 2


@pytest.mark.parametrize(
    ("raw", "expected"), [("-1", -1.0), ("0.5", 0.5), ("1.23456", 1.23456), (" 2 ", 2.0)]
)
def test_spot_price_accepts_minus_one_or_positive(raw: str, expected: float) -> None:
    assert _cfg({"spotMaxPrice": raw}).gpu_pool.spot_max_price == expected


@pytest.mark.parametrize("raw", ["0", "-0.5", "-2", "abc", "", "0.123456", "nan", "inf"])
def test_spot_price_rejects_anything_else(raw: str) -> None:
    message = _problems({"spotMaxPrice": raw})
    assert "spot-lab:spotMaxPrice must be -1" in message


# ---- validate -----------------------------------------------------------------------------------


def test_defaults_are_valid() -> None:
    validate(LabConfig(project="spot-lab", stack="dev"))


def test_gpu_min_above_max() -> None:
    message = _problems({"gpuMinNodes": "4", "gpuMaxNodes": "3"})
    assert "spot-lab:gpuMinNodes (4) must be <= spot-lab:gpuMaxNodes (3)" in message


@pytest.mark.parametrize(
    ("raw", "hidden_before"),
    [
        (
            {"gpuMinNodes": "4", "gpuMaxNodes": "3", "gpuVmSize": "Standard_D4s_v5"},
            "spot-lab:gpuMinNodes (4) must be <= spot-lab:gpuMaxNodes (3)",
        ),
        (
            {"gpuMaxNodes": "2", "maxRestarts": "-1"},
            "spot-lab:workerMaxReplicas (3) must be <= spot-lab:gpuMaxNodes (2)",
        ),
        (
            {"workerMinReplicas": "3", "workerMaxReplicas": "2", "maxRestarts": "-1"},
            "spot-lab:workerMinReplicas (3) must be <= spot-lab:workerMaxReplicas (2)",
        ),
        (
            {"globalBatchSize": "2", "imageBuilder": "kaniko"},
            "spot-lab:globalBatchSize (2) must be >= spot-lab:workerMaxReplicas (3)",
        ),
    ],
    ids=["gpu-min-max", "workers-vs-pool", "worker-min-max", "batch-vs-workers"],
)
def test_comparisons_are_reported_next_to_other_problems(
    raw: dict[str, str], hidden_before: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(raw)
    assert len(info.value.problems) == 2
    assert hidden_before in str(info.value)


def test_a_count_that_failed_to_parse_skips_only_its_comparisons() -> None:
    cfg = LabConfig(project="spot-lab", stack="dev")
    bad = replace(cfg, gpu_pool=replace(cfg.gpu_pool, min_nodes="x", vm_size="gpu"))
    with pytest.raises(ConfigError) as info:
        validate(bad)
    message = str(info.value)
    assert "spot-lab:gpuMinNodes must be an integer >= 0, got 'x'" in message
    assert "spot-lab:gpuVmSize must be" in message
    assert "gpuMinNodes (x)" not in message


@pytest.mark.parametrize(
    ("key", "value", "low"),
    [
        ("gpuMinNodes", "-1", 0),
        ("gpuMaxNodes", "0", 1),
        ("systemNodeCount", "0", 1),
        ("workerMinReplicas", "0", 1),
        ("workerReplicas", "-2", 1),
        ("maxRestarts", "-1", 0),
        ("collectiveTimeoutSeconds", "0", 1),
        ("checkpointEverySteps", "-5", 0),
        ("rdzvKeepAliveInterval", "0", 1),
        ("rdzvJoinTimeout", "-1", 1),
    ],
)
def test_negative_or_zero_counts(key: str, value: str, low: int) -> None:
    assert f"spot-lab:{key} must be an integer >= {low}, got {int(value)}" in _problems(
        {key: value}
    )


GPU_SIZE_RULE = (
    "spot-lab:gpuVmSize must be an NVIDIA full-GPU size of a family AKS installs the driver for "
    "and the NVIDIA device plugin schedules: NCasT4_v3 (T4) e.g. Standard_NC4as_T4_v3, "
)


@pytest.mark.parametrize("size", ["Standard_D4s_v5", "Standard_E8s_v5", "NC4as_T4_v3", "gpu"])
def test_gpu_pool_size_must_be_a_gpu_size(size: str) -> None:
    message = _problems({"gpuVmSize": size})
    assert GPU_SIZE_RULE in message
    assert f"got {size!r}" in message


@pytest.mark.parametrize(
    ("size", "reason"),
    [
        ("Standard_NC6s_v3", "NCv3 (V100), retired on 2025-09-30"),
        ("Standard_NC24rs_v3", "NCv3 (V100), retired on 2025-09-30"),
        ("Standard_NC6", "of a retired family"),
        ("Standard_NC12s_v2", "of a retired family"),
        ("Standard_NV6", "of a retired family"),
        ("Standard_ND24rs", "of a retired family"),
        ("Standard_NV4as_v4", "an AMD GPU"),
        ("Standard_NV28adms_V710_v5", "an AMD GPU"),
        ("Standard_ND96isr_MI300X_v5", "an AMD GPU"),
        ("Standard_NG32ads_V620_v1", "an AMD GPU"),
        ("Standard_NV6ads_A10_v5", "an NVadsA10_v5 GRID vGPU size"),
        ("Standard_NV36ads_A10_v5", "an NVadsA10_v5 GRID vGPU size"),
        ("Standard_NCC40ads_H100_v5", "a confidential GPU"),
    ],
)
def test_sizes_that_cannot_run_the_job_are_rejected_with_the_reason(size: str, reason: str) -> None:
    message = _problems({"gpuVmSize": size})
    assert GPU_SIZE_RULE in message
    assert f"({size} is {reason}" in message


def test_gpu_size_error_lists_every_family_with_an_example() -> None:
    message = _problems({"gpuVmSize": "Standard_NV12s_v3"})
    for family in gpu_sizes.FAMILIES:
        assert f"{family.name} e.g. {family.example}" in message
        assert gpu_sizes.gpu_family(family.example) == family


@pytest.mark.parametrize(
    "size",
    [
        "Standard_NC4as_T4_v3",
        "Standard_NC64as_T4_v3",
        "Standard_NC8ads_A10_v4",
        "Standard_NC24ads_A100_v4",
        "Standard_NC96ads_A100_v4",
        "Standard_NC40ads_H100_v5",
        "Standard_NC80adis_H100_v5",
        "Standard_ND96asr_v4",
        "Standard_ND96amsr_A100_v4",
        "Standard_ND96isr_H100_v5",
        "Standard_ND96isr_H200_v5",
    ],
)
def test_current_nvidia_full_gpu_sizes_are_accepted(size: str) -> None:
    assert _cfg({"gpuVmSize": size}).gpu_pool.vm_size == size


def test_system_pool_must_not_be_a_gpu_size() -> None:
    message = _problems({"systemVmSize": "Standard_NC4as_T4_v3"})
    assert "spot-lab:systemVmSize must be a CPU VM size" in message


def test_spot_price_rule_holds_for_configs_built_in_code() -> None:
    cfg = LabConfig(project="spot-lab", stack="dev")
    bad = replace(cfg, gpu_pool=replace(cfg.gpu_pool, spot_max_price=0.0))
    with pytest.raises(ConfigError, match="spot-lab:spotMaxPrice must be -1"):
        validate(bad)


def test_max_workers_above_gpu_max_nodes() -> None:
    message = _problems({"gpuMaxNodes": "2", "workerMaxReplicas": "3", "workerReplicas": "2"})
    assert "spot-lab:workerMaxReplicas (3) must be <= spot-lab:gpuMaxNodes (2)" in message


def test_worker_min_above_max() -> None:
    message = _problems({"workerMinReplicas": "3", "workerMaxReplicas": "2"})
    assert "spot-lab:workerMinReplicas (3) must be <= spot-lab:workerMaxReplicas (2)" in message


@pytest.mark.parametrize(("replicas", "start"), [("1", 2), ("2", 2), ("3", 3), ("4", 3)])
def test_start_replicas_are_clamped_into_min_max(replicas: str, start: int) -> None:
    raw = {"workerMinReplicas": "2", "workerMaxReplicas": "3", "workerReplicas": replicas}
    job = _cfg(raw).job
    assert job.replicas == int(replicas)
    assert job.start_replicas == start


@pytest.mark.parametrize("prefix", ["SpotLab", "spot-lab", "1lab", "a", "averyveryverylongprefix"])
def test_name_prefix_must_fit_storage_account_rules(prefix: str) -> None:
    message = _problems({"namePrefix": prefix})
    assert "spot-lab:namePrefix must be 2-12 lowercase letters or digits" in message
    assert "3-24 lowercase alphanumerics" in message


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_fsdp2_takes_every_precision(precision: str) -> None:
    # fp16-mixed too: the cheapest Spot GPUs (T4, V100) have no bf16.
    raw = {"parallelism": "fsdp2", "precision": precision, "task": "charlm"}
    job = _cfg(raw).job
    assert (job.parallelism, job.precision) == ("fsdp2", precision)


def test_fsdp2_with_a_task_that_cannot_be_sharded_is_refused_at_preview() -> None:
    message = _problems({"parallelism": "fsdp2", "task": "cifar"})
    assert "spot-lab:parallelism fsdp2: spot-lab:task cifar cannot be sharded" in message
    assert "(fsdp2 tasks: charlm); use ddp" in message


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("imageBuilder", "kaniko", "acr, docker"),
    ],
)
def test_unknown_enum_values(key: str, value: str, allowed: str) -> None:
    assert f"spot-lab:{key} must be one of {allowed}; got {value!r}" in _problems({key: value})


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("kubernetesVersion", "latest", "spot-lab:kubernetesVersion must be empty"),
        ("namespace", "Spot_Lab", "spot-lab:namespace must be a DNS label"),
        ("workerCpu", "three", "spot-lab:workerCpu must be a CPU quantity"),
        ("workerMemory", "12GB", "spot-lab:workerMemory must be a memory quantity"),
        ("hpaCpuUtilization", "150", "spot-lab:hpaCpuUtilization must be 0"),
        ("globalBatchSize", "2", "spot-lab:globalBatchSize (2) must be >="),
        (
            "precision",
            "fp8",
            "spot-lab:precision must be one of fp32, bf16-mixed, fp16-mixed, got 'fp8'",
        ),
        (
            "parallelism",
            "zero3",
            "spot-lab:parallelism must be one of ddp, fsdp2, got 'zero3'",
        ),
        ("runId", "Run 2", "spot-lab:runId must be 1-20 lowercase letters, digits or '-'"),
        ("runId", "", "spot-lab:runId must be 1-20 lowercase letters"),
        ("runId", "-2", "spot-lab:runId must be 1-20 lowercase letters"),
        ("runId", "r" * 21, "spot-lab:runId must be 1-20 lowercase letters"),
        ("terminationGraceSeconds", "30", "spot-lab:terminationGraceSeconds must be 4-29"),
        ("terminationGraceSeconds", "3", "spot-lab:terminationGraceSeconds must be 4-29"),
    ],
)
def test_other_rules_name_their_key(key: str, value: str, fragment: str) -> None:
    assert fragment in _problems({key: value})


def test_a_stack_name_too_long_for_azure_names_is_refused() -> None:
    longest = naming.longest_stack_name("spotlab", "westus3")
    assert longest == 22
    load({}, "spot-lab", "s" * longest)  # fits: no error from load
    validate(load({}, "spot-lab", "s" * longest))
    stack = "s" * (longest + 1)
    with pytest.raises(ConfigError) as info:
        validate(load({}, "spot-lab", stack))
    message = str(info.value)
    assert f"stack name {stack!r} is too long" in message
    assert "the AKS node resource group" in message and "Azure allows 80" in message
    assert "a stack name may have at most 22 characters" in message
    assert "spot-lab:namePrefix" in message


def test_the_dns_prefix_limit_is_named_when_the_cluster_name_breaks_it() -> None:
    # A short region leaves the 54-character DNS prefix as the limit that bites first.
    stack = "s" * 43
    with pytest.raises(ConfigError) as info:
        validate(load({}, "spot-lab", stack, "x1"))
    assert "AKS cluster name (also its DNS prefix)" in str(info.value)
    assert "Azure allows 54" in str(info.value)


def test_stack_limits_follow_prefix_and_region() -> None:
    assert naming.longest_stack_name("a" * 12, "australiasoutheast") == 12
    assert naming.longest_stack_name("ab", "x1") > naming.longest_stack_name("ab", "westus3")


@pytest.mark.parametrize("run_id", ["1", "2", "2025-06-01", "retry-after-oom"])
def test_run_ids_that_fit_a_label_are_accepted(run_id: str) -> None:
    assert _cfg({"runId": run_id}).job.run_id == run_id


def test_checkpoints_must_be_saved_somehow() -> None:
    message = _problems({"checkpointEverySteps": "0", "checkpointEverySeconds": "0"})
    assert "no checkpoint would ever be saved" in message


def test_bad_location_names_both_keys() -> None:
    with pytest.raises(ConfigError, match="azure-native:location \\(or spot-lab:location\\)"):
        _cfg(location="West US 3")


def test_a_removed_key_says_why_it_went() -> None:
    with pytest.raises(ConfigError, match="checkpointBackend was removed: checkpoints always go"):
        _cfg({"checkpointBackend": "mount"})


def test_validate_reports_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        _cfg({"gpuVmSize": "Standard_D4s_v5", "namePrefix": "X", "imageBuilder": "kaniko"})
    assert len(info.value.problems) == 3


def test_every_size_in_the_table_belongs_to_an_accepted_family() -> None:
    for size in gpu_sizes.SIZES:
        assert size.family in gpu_sizes.FAMILIES
        assert size.gpus >= 1 and size.vcpus >= 4 and size.memory_gib > size.vcpus
    assert gpu_sizes.gpu_size("standard_nc48ads_a100_v4").gpus == 2
    assert gpu_sizes.gpu_size("Standard_NV12s_v3") is None


def test_active_deadline_is_optional_and_positive() -> None:
    assert _cfg({}).job.active_deadline_s is None
    assert _cfg({"activeDeadlineSeconds": "86400"}).job.active_deadline_s == 86400
    message = _problems({"activeDeadlineSeconds": "0"})
    assert "spot-lab:activeDeadlineSeconds must be an integer >= 1, got 0" in message


def test_data_staging_defaults_to_the_official_archive_and_can_be_turned_off() -> None:
    cfg = _cfg({})
    assert cfg.data_source.url.startswith("https://www.cs.toronto.edu/")
    assert cfg.data_source.checksum == "md5:c32a1d4ab5d03f1284b67883e8d87530"
    assert cfg.data_source.format == "cifar10" and cfg.data.staged
    off = _cfg({"dataSourceUrl": "none", "dataSourceChecksum": "ignored"}).data
    assert not off.staged


def test_the_charlm_task_stages_tiny_shakespeare_by_default_or_a_mirror() -> None:
    source = _cfg({"task": "charlm"}).data_source
    # The checksum was computed from karpathy/char-rnn's blob at the commit the URL pins.
    assert source.url == (
        "https://raw.githubusercontent.com/karpathy/char-rnn/"
        "6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e/data/tinyshakespeare/input.txt"
    )
    assert source.checksum == (
        "sha256:86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    )
    assert source.format == "text"
    mirror = {
        "dataSourceUrl": "https://mirror.example/input.txt",
        "dataSourceChecksum": "md5:" + "a" * 32,
    }
    source = _cfg({"task": "charlm", **mirror}).data_source
    assert (source.url, source.format) == ("https://mirror.example/input.txt", "text")


def test_a_task_of_the_users_own_module_is_checked_by_its_shape_and_uploads_its_data() -> None:
    cfg = _cfg(
        {"task": "my_package.my_module:spec", "taskPackage": "../my-repo", "dataSourceUrl": "none"}
    )
    assert cfg.task == "my_package.my_module:spec" and not cfg.data.staged
    assert "my_package" not in sys.modules  # its module is the image's, never imported here


def test_a_task_of_a_module_the_image_cannot_hold_names_task_and_task_package() -> None:
    message = _problems({"task": "my_package.my_module:spec", "dataSourceUrl": "none"})
    assert "spot-lab:task my_package.my_module:spec is neither a built-in task" in message
    assert "set spot-lab:taskPackage to the directory that holds my_package/" in message
    # A module of the image's own training package needs no package.
    assert _cfg({"task": "training.tasks.charlm:SPEC", "dataSourceUrl": "none"})


def test_every_task_of_the_image_has_a_data_source_and_nothing_else() -> None:
    from training.tasks import TASKS

    assert set(stack_config.TASKS) == set(TASKS)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"dataSourceUrl": "http://mirror/cifar.tgz"},
            "spot-lab:dataSourceUrl must be an https://",
        ),
        (
            {"dataSourceUrl": "https://mirror.example/c.tgz", "dataSourceChecksum": "c32a1d4a"},
            "spot-lab:dataSourceChecksum must be md5:<32 hex",
        ),
        (
            {"dataSourceUrl": "https://mirror.example/c.tgz"},
            "spot-lab:dataSourceChecksum must be md5:<32 hex digits> or sha256:<64 hex "
            "digits> of what spot-lab:dataSourceUrl serves (required with a URL of your own)",
        ),
        (
            {"dataSourceChecksum": "md5:" + "a" * 32},
            "spot-lab:dataSourceChecksum is set but spot-lab:dataSourceUrl is empty",
        ),
        (
            {"task": "gpt"},
            "spot-lab:task must be one of cifar, charlm, or a TrainSpec of your own module as "
            "module.path:attribute, got 'gpt'",
        ),
        (
            {"task": "my_package.my_module:spec"},
            "spot-lab:task my_package.my_module:spec is a task of your own module: set "
            "spot-lab:dataSourceUrl to 'none'",
        ),
    ],
)
def test_data_staging_settings_are_checked(override: dict[str, str], message: str) -> None:
    assert message in _problems(override)


def test_a_multi_gpu_size_gives_a_process_and_a_gpu_per_gpu() -> None:
    cfg = _cfg({"gpuVmSize": "Standard_NC48ads_A100_v4", "globalBatchSize": "256"})
    assert cfg.gpus_per_node == 2
    # Empty requests take what the node leaves: far more than one T4 node's.
    cpu, memory = cfg.worker_requests
    assert cpu == "46600m" and memory == "419Gi"
    assert _cfg({}).worker_requests == ("3000m", "20Gi")
    assert _cfg({"workerCpu": "2", "workerMemory": "8Gi"}).worker_requests == ("2", "8Gi")


def _millis(cpu: str) -> int:
    return int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)


@pytest.mark.parametrize("size", gpu_sizes.SIZES, ids=lambda size: size.name)
def test_the_default_requests_leave_room_for_a_gpu_nodes_daemonsets(
    size: gpu_sizes.GpuSize,
) -> None:
    """The worker's default requests, plus every DaemonSet a GPU node of this cluster runs with
    Azure Monitor on, fit the node's allocatable as AKS computes it: otherwise the worker stays
    Pending on a node that has its GPU free."""
    cpu, memory = _cfg({"gpuVmSize": size.name}).worker_requests
    daemonsets_cpu = sum(ds.cpu_millis for ds in gpu_sizes.NODE_DAEMONSETS)
    daemonsets_memory = sum(ds.memory_mib for ds in gpu_sizes.NODE_DAEMONSETS)
    cpu_allocatable, memory_allocatable = gpu_sizes.node_allocatable(size)
    assert _millis(cpu) + daemonsets_cpu <= cpu_allocatable
    assert int(memory.removesuffix("Gi")) * 1024 + daemonsets_memory <= memory_allocatable
    # The reserve itself covers the DaemonSets listed, with room for what is not.
    assert daemonsets_cpu <= gpu_sizes.DAEMONSET_CPU_MILLIS
    assert daemonsets_memory <= gpu_sizes.DAEMONSET_MEMORY_MIB


def test_requests_that_do_not_fit_the_node_are_refused() -> None:
    message = _problems({"workerCpu": "4", "workerMemory": "32Gi"})
    assert "spot-lab:workerCpu (4) must fit on a Standard_NC4as_T4_v3 node, which leaves 3060m" in (
        message
    )
    assert "spot-lab:workerMemory (32Gi) must fit on a Standard_NC4as_T4_v3 node" in message


def test_every_rank_of_every_gpu_needs_a_sample() -> None:
    message = _problems(
        {"gpuVmSize": "Standard_ND96asr_v4", "workerMaxReplicas": "3", "globalBatchSize": "16"}
    )
    assert "spot-lab:globalBatchSize (16) must be >= spot-lab:workerMaxReplicas (3) x 8 GPUs" in (
        message
    )


def test_a_size_the_family_pattern_allows_but_azure_does_not_offer_is_refused() -> None:
    message = _problems({"gpuVmSize": "Standard_NC12as_T4_v3"})
    assert "'Standard_NC12as_T4_v3' is not a size Azure offers in its family" in message
    assert "Standard_NC64as_T4_v3" in message


def test_more_heartbeats_than_the_rendezvous_was_measured_with_are_refused() -> None:
    big = {"gpuMaxNodes": "100", "workerMaxReplicas": "100", "globalBatchSize": "512"}
    message = _problems(big)
    assert (
        "spot-lab:workerMaxReplicas (100) with spot-lab:rdzvKeepAliveInterval (1) is 100 "
        "heartbeats a second on etcd; the rendezvous is measured safe up to 64"
    ) in message
    assert "set spot-lab:rdzvKeepAliveInterval to 2 or more" in message
    assert "spot-lab:workerMaxReplicas to 64 or less" in message
    # Beating half as often keeps etcd's load within what was measured.
    assert _cfg({**big, "rdzvKeepAliveInterval": "2"}).job.max_replicas == 100
    assert _cfg({"gpuMaxNodes": "64", "workerMaxReplicas": "64"}).job.max_replicas == 64


def test_the_gpu_pools_together_stay_within_what_the_autoscaler_tolerates_unready() -> None:
    """catalog.gpu_pools.MAX_GPU_NODES is the autoscaler's ok-total-unready-count."""
    _cfg({"gpuMaxNodes": "98", "onDemandMaxNodes": "2"})  # 100: allowed
    message = _problems({"gpuMaxNodes": "99", "onDemandMaxNodes": "2"})
    assert "spot-lab:gpuMaxNodes (99) plus spot-lab:onDemandMaxNodes (2) must be at most 100" in (
        message
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"etcdMembers": "2"}, "spot-lab:etcdMembers must be 1 (a throwaway dev stack) or an odd"),
        ({"etcdMembers": "0"}, "spot-lab:etcdMembers must be 1"),
        (
            {"systemNodeCount": "2"},
            "spot-lab:systemNodeCount (2) must be >= spot-lab:etcdMembers (3): each etcd member",
        ),
        (
            {"etcdMembers": "5", "systemNodeCount": "4"},
            "spot-lab:systemNodeCount (4) must be >= spot-lab:etcdMembers (5)",
        ),
    ],
)
def test_etcd_members_need_a_quorum_and_a_system_node_each(
    raw: dict[str, str], message: str
) -> None:
    assert message in _problems(raw)


def test_one_etcd_member_on_one_system_node_is_a_dev_stack() -> None:
    cfg = _cfg({"etcdMembers": "1", "systemNodeCount": "1"})
    assert (cfg.etcd_members, cfg.cluster.system_node_count) == (1, 1)


def test_rdma_follows_the_sizes_infiniband_unless_turned_off() -> None:
    assert _cfg({}).infiniband is False  # the T4 has none
    nd = {"gpuVmSize": "Standard_ND96asr_v4", "globalBatchSize": "256"}
    assert _cfg(nd).infiniband is True
    assert _cfg({**nd, "rdma": "off"}).infiniband is False
    assert _cfg({**nd, "rdma": "on"}).infiniband is True


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"rdma": "yes"}, "spot-lab:rdma must be one of auto, on, off; got 'yes'"),
        (
            {"rdma": "on"},
            "spot-lab:rdma on: Standard_NC4as_T4_v3 has no InfiniBand (sizes with it: "
            "Standard_ND96asr_v4,",
        ),
    ],
)
def test_rdma_refuses_what_cannot_be(raw: dict[str, str], message: str) -> None:
    assert message in _problems(raw)
