"""``--precision``: mixed precision owned by the loop. bf16-mixed runs on the CPU, so here a
peer lost mid accumulation (what a survivor of a killed node sees) and a SIGTERM lose no step,
and the run ends on exactly the parameters of an uninterrupted bf16-mixed run at the same world
size (across world sizes bf16's rounding differs; a resume at the same one repeats it). fp16's
gradient scaler is part of the checkpoint and resumes where it was. Parameters, optimizer
state and checkpoints stay float32. A bad value is one line and exit 2.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.elastic_cluster import PARAMETERS, final_parameters, max_abs_difference
from tests.support.exactness import (
    flags,
    make_data,
    raising_in_micro_batch,
    reference,
    run_here,
)
from tests.support.peer_failures import gloo_peer_closed
from tests.support.trainer_harness import Harness, saved_checkpoint, sigterm_during, under
from training.checkpoints.sharded.state import unpack
from training.elastic.exit_codes import BAD_INPUT, OK, WORKER_RESTART
from training.loop.config import ConfigError, parse_config
from training.records import EMERGENCY_SAVE, RESUMED
from training.tasks import TASKS

pytestmark = pytest.mark.timeout(300)
REPO_ROOT = Path(__file__).resolve().parents[3]
REQUIRED = ["--data-dir", "/d", "--checkpoint-uri", "/c"]
MAX_STEPS = 8


def _args(precision: str, *extra: str) -> list[str]:
    # The exactness flags, in float32: mixed precision computes from float32 parameters.
    args = flags("charlm", "--dropout=0.1", f"--max-steps={MAX_STEPS}", *extra)
    return [*args, "--dtype=float32", f"--precision={precision}"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, training: None) -> Path:
    return make_data("charlm", tmp_path_factory.mktemp("data"))


def _saved(root: Path) -> dict:
    return saved_checkpoint(root / "durable")


def _scaler(root: Path) -> dict:
    return under(_saved(root), "trainer.extras.scaler.")


def _sigterm_in_step_4(h: Harness, stop: SimpleNamespace) -> None:
    sigterm_during(h, 4, stop)


def test_bf16_mixed_computes_in_bf16_and_keeps_float32_state(data: Path, tmp_path: Path) -> None:
    seen: list[torch.dtype] = []

    def loss(model: torch.nn.Module, batch: dict, where: object) -> object:
        seen.append(model(batch["windows"][:, :-1]).dtype)  # under the loop's autocast
        return TASKS["charlm"].loss(model, batch, where)

    spec = replace(TASKS["charlm"], loss=loss)
    _, code = run_here(tmp_path, data, _args("bf16-mixed", "--max-steps=2"), spec=spec)
    assert code == OK
    assert set(seen) == {torch.bfloat16}
    saved = _saved(tmp_path)
    weights = under(saved, "model.model.")
    assert {v.dtype for v in weights.values()} == {torch.float32}
    moments = [v for k, v in under(saved, "model.optimizer.state.").items() if k.endswith("avg")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert not under(saved, "trainer.extras.scaler.")
    assert unpack(saved["run"])["precision"] == "bf16-mixed"
    fp32, code = run_here(tmp_path / "fp32", data, _args("fp32", "--max-steps=2"))
    assert code == OK
    parameters = {k: v for k, v in saved.items() if k.startswith(PARAMETERS)}
    assert max_abs_difference(final_parameters(tmp_path / "fp32" / "durable"), parameters) > 0


@pytest.mark.parametrize("fault", ["peer_lost", "sigterm"])
def test_bf16_mixed_through_a_fault_loses_no_step_and_repeats_the_run(
    fault: str, data: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = _args("bf16-mixed")
    expected = reference(tmp_path_factory.mktemp("bf16"), data, args)
    if fault == "peer_lost":
        faulty = raising_in_micro_batch(
            TASKS["charlm"], step=5, micro_batch=1, error=gloo_peer_closed
        )
        first, code = run_here(tmp_path, data, args, spec=faulty)
        stopped_at = 5
    else:
        first, code = run_here(tmp_path, data, args, before=_sigterm_in_step_4)
        stopped_at = 4
    assert code == WORKER_RESTART
    (save,) = first.events(EMERGENCY_SAVE)
    assert save["step"] == stopped_at
    second, code = run_here(tmp_path, data, args)
    assert code == OK
    (resumed,) = second.events(RESUMED)
    assert (resumed["source"], resumed["step"], resumed["lost_steps"]) == ("local", stopped_at, 0)
    assert max_abs_difference(final_parameters(tmp_path / "durable"), expected) == 0.0


def test_fp16_mixeds_scaler_is_saved_and_resumed(
    data: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = _args("fp16-mixed")
    whole = tmp_path_factory.mktemp("fp16")
    expected = reference(whole, data, args)
    _, code = run_here(tmp_path, data, args, before=_sigterm_in_step_4)
    assert code == WORKER_RESTART
    # The scaler moved from its start (a grown tracker, or a scale halved by an overflow):
    # one not restored would start over at step 4.
    assert _scaler(tmp_path) != torch.amp.GradScaler("cpu").state_dict()
    _, code = run_here(tmp_path, data, args)
    assert code == OK
    # The same scale and growth tracker at the end, and the same steps skipped on overflow.
    assert _scaler(tmp_path) == _scaler(whole)
    assert max_abs_difference(final_parameters(tmp_path / "durable"), expected) == 0.0


def test_the_precision_is_part_of_the_runs_identity(data: Path, tmp_path: Path) -> None:
    _, code = run_here(tmp_path, data, _args("fp16-mixed", "--max-steps=2"))
    assert code == OK
    with pytest.raises(ConfigError, match="precision='fp16-mixed'; this run has precision=None"):
        run_here(tmp_path, data, _args("fp32", "--max-steps=4"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--precision", "fp8"],
            r"--precision \(or TRAIN_PRECISION\) must be one of fp32, bf16-mixed, fp16-mixed, "
            "got 'fp8'",
        ),
        (
            ["--precision", "bf16-mixed", "--dtype", "float64"],
            r"--precision bf16-mixed computes from float32 parameters: --dtype \(or TRAIN_DTYPE\) "
            "must be float32 with it, got float64",
        ),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config([*REQUIRED, *argv], env={})
    assert parse_config(REQUIRED, env={"TRAIN_PRECISION": "bf16-mixed"}).run.precision == (
        "bf16-mixed"
    )


@pytest.mark.usefixtures("processes")
def test_train_exits_2_with_one_line_for_fp8(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "training.train", "--precision=fp8"]
        + [f"--data-dir={tmp_path}", f"--checkpoint-uri={tmp_path / 'durable'}"],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == BAD_INPUT, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "--precision" in line]
    assert len(lines) == 1 and "fp32, bf16-mixed, fp16-mixed" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
