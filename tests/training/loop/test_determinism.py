"""``--deterministic`` and ``--dtype float64``: what a CPU can show of them.

The settings are global to a process, so each check runs in a fresh interpreter. What only a GPU
shows (cuDNN's algorithm choice, TF32 convolutions, cuBLAS's workspace) is what the settings
below switch off; docs/training.md says what holds with and without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.elastic_cluster import final_parameters
from tests.support.trainer_harness import TINY

REPO = Path(__file__).resolve().parents[3]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "CUBLAS_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.usefixtures("processes")
def test_deterministic_mode_applies_every_setting() -> None:
    result = _python(
        "import json\n"
        "from training.loop.determinism import use_deterministic_algorithms\n"
        "print(json.dumps(use_deterministic_algorithms()))\n"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == {
        "deterministic_algorithms": True,
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "matmul_fp32_precision": "ieee",
        "cudnn_conv_fp32_precision": "ieee",  # torch 2.13's default for convolutions is tf32
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }


@pytest.mark.usefixtures("processes")
def test_a_users_deterministic_cublas_workspace_is_kept() -> None:
    code = "from training.loop.determinism import use_deterministic_algorithms as u; print(u())"
    result = _python(code, CUBLAS_WORKSPACE_CONFIG=":16:8")
    assert result.returncode == 0 and "':16:8'" in result.stdout, result.stderr[-2000:]


def _train(data_dir: Path, root: Path, *flags: str) -> dict[str, torch.Tensor]:
    """A plain ``python -m training.train`` run (a world of one); its final parameters."""
    args = [f"--data-dir={data_dir}", f"--checkpoint-uri={root / 'durable'}"]
    args += [f"--local-dir={root / 'local'}", *TINY, "--max-steps=4", *flags]
    code = f"import sys\nfrom training.train import main\nsys.exit(main({args!r}))\n"
    result = _python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    return final_parameters(root / "durable")


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(300)
def test_a_deterministic_cpu_run_repeats_bitwise(data_dir: Path, tmp_path: Path) -> None:
    first = _train(data_dir, tmp_path / "a", "--deterministic=true")
    second = _train(data_dir, tmp_path / "b", "--deterministic=true")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(300)
def test_float64_trains_in_float64_and_is_its_own_run(data_dir: Path, tmp_path: Path) -> None:
    params = _train(data_dir, tmp_path, "--dtype=float64")
    assert {t.dtype for t in params.values() if t.is_floating_point()} == {torch.float64}
    # Resuming its state in float32 would go on from a trajectory this run never had.
    code = (
        "import sys\nfrom training.train import main\n"
        f"sys.exit(main(['--data-dir={data_dir}', '--checkpoint-uri={tmp_path / 'durable'}',"
        f" '--local-dir={tmp_path / 'local2'}', *{TINY!r}, '--max-steps=6']))\n"
    )
    result = _python(code)
    assert result.returncode == 2 and "dtype='float64'" in result.stderr, result.stderr[-2000:]
