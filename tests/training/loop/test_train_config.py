"""The training program's flags: defaults, then TRAIN_* env, then flags; clear errors."""

from __future__ import annotations

from dataclasses import fields

import pytest

from training.elastic.launch import ElasticPolicy, RendezvousSettings, train_command, worker_env
from training.loop.config import ConfigError, TrainConfig, check_batch_fits, parse_config

REQUIRED = ["--data-dir", "/data", "--checkpoint-uri", "/ckpt"]


def test_defaults_then_env_then_flags() -> None:
    env = {"TRAIN_MAX_STEPS": "50", "TRAIN_LR": "0.2", "TRAIN_CHECKPOINT_URI": "/from-env"}
    cfg = parse_config(["--data-dir", "/data", "--max-steps", "70"], env=env)
    assert cfg.run.max_steps == 70  # the flag beats the env
    assert cfg.optim.lr == 0.2  # the env beats the default
    assert cfg.checkpoint.checkpoint_uri == "/from-env"
    assert cfg.optim.global_batch_size == 256  # the default


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--checkpoint-uri", "/c"], {}, "--data-dir .*TRAIN_DATA_DIR.* is required"),
        (["--data-dir", "/d"], {}, "--checkpoint-uri .* is required"),
        ([*REQUIRED, "--max-steps", "ten"], {}, "--max-steps must be int, got 'ten'"),
        (REQUIRED, {"TRAIN_GLOBAL_BATCH_SIZE": "x"}, "TRAIN_GLOBAL_BATCH_SIZE must be int"),
        ([*REQUIRED, "--global-batch-size", "0"], {}, "--global-batch-size must be >= 1, got 0"),
        ([*REQUIRED, "--collective-timeout-s", "0"], {}, "--collective-timeout-s must be >= 1"),
        ([*REQUIRED, "--checkpoint-keep", "0"], {}, "--checkpoint-keep must be >= 1"),
        ([*REQUIRED, "--restore-timeout-s", "0"], {}, "--restore-timeout-s must be >= 1, got 0"),
        (REQUIRED, {"TRAIN_RESTORE_TIMEOUT_S": "soon"}, "TRAIN_RESTORE_TIMEOUT_S must be int"),
        ([*REQUIRED, "--lr", "-1"], {}, "--lr must be > 0"),
        (
            [*REQUIRED, "--stop-deadline-s", "0.5"],
            {},
            r"--stop-deadline-s \(or TRAIN_STOP_DEADLINE_S\) must be between 1 and 600 seconds, "
            "got 0.5: keep it below the pod's termination grace",
        ),
        (
            REQUIRED,
            {"TRAIN_STOP_DEADLINE_S": "9000"},
            "must be between 1 and 600 seconds, got 9000",
        ),
        (
            [*REQUIRED, "--dtype", "half"],
            {},
            "--dtype .* must be one of float32, float64, got 'half'",
        ),
        ([*REQUIRED, "--deterministic", "maybe"], {}, "--deterministic must be true or false"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(argv, env=env)


def test_help_describes_every_flag_with_its_env_and_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--help"], env={})
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for section in TrainConfig().sections():
        for f in fields(section):
            assert f"(env TRAIN_{f.name.upper()}, default {getattr(section, f.name)!r})" in text
    assert "Samples per optimiser step, whatever the world size." in text


def test_the_eviction_deadline_fits_the_spot_notice_by_default() -> None:
    cfg = parse_config(REQUIRED, env={})
    assert cfg.checkpoint.stop_deadline_s == 25.0  # of the 30 s termination grace
    assert (cfg.run.dtype, cfg.run.deterministic) == ("float32", False)
    cfg = parse_config([*REQUIRED, "--deterministic", "true", "--dtype", "float64"], env={})
    assert (cfg.run.dtype, cfg.run.deterministic) == ("float64", True)


def test_unknown_flag_is_rejected() -> None:
    with pytest.raises(SystemExit):
        parse_config([*REQUIRED, "--max-step", "3"], env={})


def test_elastic_policy_is_torchruns_env() -> None:
    policy = ElasticPolicy(
        rdzv_host="etcd.lab.svc", rdzv_id="job-1", min_nodes=1, max_nodes=4, max_restarts=50
    )
    env = policy.pet_env()
    assert env["PET_RDZV_BACKEND"] == "etcd"
    assert env["PET_RDZV_ENDPOINT"] == "etcd.lab.svc:2379"
    assert env["PET_NNODES"] == "1:4"
    assert (
        env["PET_RDZV_CONF"]
        == "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=900"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_nodes": 0}, "min_nodes must be >= 1"),
        ({"min_nodes": 3, "max_nodes": 2}, r"max_nodes \(2\) must be >= min_nodes \(3\)"),
        ({"rdzv_id": ""}, "rdzv_id must not be empty"),
        (
            {"rendezvous": RendezvousSettings(last_call_timeout_s=0)},
            "last_call_timeout_s must be an integer >= 1",
        ),
    ],
)
def test_elastic_policy_validation(kwargs: dict, message: str) -> None:
    base = {"rdzv_host": "h", "rdzv_id": "r", "min_nodes": 1, "max_nodes": 2, "max_restarts": 3}
    with pytest.raises(ValueError, match=message):
        ElasticPolicy(**{**base, **kwargs}).validate()


def test_worker_env_carries_the_scale_up_workaround_and_timeouts() -> None:
    env = worker_env(checkpoint_uri="/ckpt", local_dir="/local", collective_timeout_s=30)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TRAIN_COLLECTIVE_TIMEOUT_S"] == "30"
    # NCCL: the watchdog aborts the communicator but leaves the process to save; blocking
    # wait off, or it would take precedence; "is there a GPU?" asked through NVML.
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    assert train_command(["--max-steps", "5"]) == [
        "python",
        "-m",
        "training.agent",
        "--module",
        "training.train",
        "--max-steps",
        "5",
    ]


@pytest.mark.parametrize(
    ("raw", "expected"), [("false", False), ("0", False), ("TRUE", True), ("yes", True)]
)
def test_boolean_flags(raw: str, expected: bool) -> None:
    assert (
        parse_config([*REQUIRED, "--emergency-saves", raw], env={}).checkpoint.emergency_saves
        is expected
    )


def test_boolean_flag_rejects_other_words() -> None:
    with pytest.raises(ConfigError, match="--emergency-saves must be true or false, got 'maybe'"):
        parse_config([*REQUIRED, "--emergency-saves", "maybe"], env={})


def test_restore_timeout_defaults_long_and_reads_env() -> None:
    assert parse_config(REQUIRED, env={}).checkpoint.restore_timeout_s == 600
    cfg = parse_config(REQUIRED, env={"TRAIN_RESTORE_TIMEOUT_S": "90"})
    assert cfg.checkpoint.restore_timeout_s == 90


@pytest.mark.parametrize(
    ("batch", "samples", "world", "message"),
    [
        (64, 48, 2, "between 2 .* and 48 .*, got 64"),
        (2, 48, 3, "between 3 \\(the world size.*got 2"),
    ],
)
def test_a_global_batch_that_cannot_be_split_names_the_flag_and_range(
    batch: int, samples: int, world: int, message: str
) -> None:
    cfg = parse_config([*REQUIRED, "--global-batch-size", str(batch)], env={})
    with pytest.raises(ConfigError, match="--global-batch-size .*TRAIN_GLOBAL_BATCH_SIZE"):
        check_batch_fits(cfg, samples, world)
    with pytest.raises(ConfigError, match=message):
        check_batch_fits(cfg, samples, world)


def test_a_global_batch_at_the_bounds_fits() -> None:
    cfg = parse_config([*REQUIRED, "--global-batch-size", "48"], env={})
    check_batch_fits(cfg, 48, 48)
