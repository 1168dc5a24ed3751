"""The container entry point: a clear error for an unusable rendezvous, else torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary, free_port
from training.agent import check_rendezvous, etcd_v2_problem, main

REPO = Path(__file__).resolve().parents[2]


def _env(endpoint: str, backend: str = "etcd-v2") -> dict[str, str]:
    return {"PET_RDZV_BACKEND": backend, "PET_RDZV_ENDPOINT": endpoint}


def test_a_healthy_etcd_passes_and_torchrun_replaces_the_process(etcd_server: EmbeddedEtcd) -> None:
    calls: list[tuple[str, list[str]]] = []
    env = {
        **_env(f"127.0.0.1:{etcd_server.client_port}"),
        "TRAIN_RDZV_WAIT_S": "0",
        "TRAIN_LAUNCHER": "torchrun",
    }
    assert (
        main(["--module", "training.train"], env=env, execv=lambda p, a: calls.append((p, a))) == 0
    )
    assert calls == [
        (
            sys.executable,
            [sys.executable, "-m", "torch.distributed.run", "--module", "training.train"],
        )
    ]


def test_unreachable_etcd_names_the_endpoint_and_the_setting() -> None:
    waited: list[float] = []
    problem = check_rendezvous(_env(f"127.0.0.1:{free_port()}"), wait_s=0, sleep=waited.append)
    assert problem is not None
    assert "cannot reach etcd at 127.0.0.1:" in problem
    assert "PET_RDZV_ENDPOINT" in problem and "rdzvHost" in problem


def test_it_waits_for_an_etcd_that_is_still_starting() -> None:
    answers = iter(["cannot reach etcd at e:2379 (refused)", "cannot reach etcd", None])
    sleeps: list[float] = []
    assert (
        check_rendezvous(
            _env("e:2379"), wait_s=60, probe=lambda _: next(answers), sleep=sleeps.append
        )
        is None
    )
    assert sleeps == [1.0, 1.0]


@pytest.mark.usefixtures("torchrun")
def test_an_etcd_without_the_v2_api_fails_at_once(tmp_path: Path) -> None:
    port, peer = free_port(), free_port()
    etcd = subprocess.Popen(
        [
            str(find_etcd_binary()),
            "--data-dir",
            str(tmp_path),
            f"--listen-client-urls=http://127.0.0.1:{port}",
            f"--advertise-client-urls=http://127.0.0.1:{port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            problem = etcd_v2_problem(f"127.0.0.1:{port}")
            if problem and "v2 API" in problem:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert problem is not None and "--enable-v2=true" in problem
    finally:
        etcd.kill()
        etcd.wait()


def test_other_backends_are_not_checked() -> None:
    assert check_rendezvous({"PET_RDZV_BACKEND": "c10d"}, wait_s=0) is None
    assert check_rendezvous({}, wait_s=0) is None


@pytest.mark.usefixtures("torchrun")
def test_the_command_line_exits_2_with_the_message() -> None:
    env = {**_env(f"127.0.0.1:{free_port()}"), "TRAIN_RDZV_WAIT_S": "0", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "training.agent", "--module", "training.train"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "rendezvous check failed: cannot reach etcd" in result.stderr


def _agent(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "training.agent", *args],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "TRAIN_RDZV_WAIT_S": "0", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.usefixtures("torchrun")
def test_an_unknown_launcher_names_the_setting_and_the_choices() -> None:
    result = _agent(["--module", "training.train"], {"TRAIN_LAUNCHER": "fast"})
    assert result.returncode == 2
    assert "TRAIN_LAUNCHER must be one of warm, torchrun, got 'fast'" in result.stderr


def test_the_warm_launcher_runs_the_training_module_only(etcd_server: EmbeddedEtcd) -> None:
    env = {**_env(f"127.0.0.1:{etcd_server.client_port}"), "TRAIN_LAUNCHER": "warm"}
    result = _agent(["--nnodes=1", "--module", "other.module"], env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "runs --module training.train only, got 'other.module'" in result.stderr
    assert "TRAIN_LAUNCHER=torchrun" in result.stderr


def test_the_warm_launcher_refuses_bad_training_flags_before_it_joins(
    etcd_server: EmbeddedEtcd,
) -> None:
    env = {**_env(f"127.0.0.1:{etcd_server.client_port}"), "TRAIN_LAUNCHER": "warm"}
    args = ["--nnodes=1", "--module", "training.train", "--data-dir", "/d", "--max-steps", "ten"]
    result = _agent([*args, "--checkpoint-uri", "/c"], env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--max-steps must be int, got 'ten'" in result.stderr
    assert "rendezvous" not in result.stderr.lower().replace("rendezvous check", "")
