"""What a resume may change, and a start from another run's weights.

A resume under another learning rate or schedule length logs the change and uses the new value
from the next step: the run ends, in float64, where an uninterrupted run ends whose schedule
switched to the new value at that step. What shapes the state (the model's size) is still
refused. ``--init-from`` starts a new run at step 0 from another run's newest weights."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.elastic_cluster import final_parameters, max_abs_difference
from tests.support.exactness import TOLERANCE, flags, make_data, matches, run_here
from tests.support.trainer_harness import harness, one_process_world
from training.elastic.exit_codes import BAD_INPUT, OK
from training.loop.config import ConfigError
from training.records import INITIALIZED, RESUMED, SETTINGS_CHANGED
from training.tasks import TASKS
from training.tasks.charlm import warmup_cosine

pytestmark = pytest.mark.timeout(300)
REPO_ROOT = Path(__file__).resolve().parents[3]
CHANGED_AT, MAX_STEPS = 6, 10


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, training: None) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {task: make_data(task, root / task) for task in ("charlm", "cifar")}


def switching_at(task: str, step: int, factor: Callable[[int], float]) -> Any:
    """``task`` whose learning rate is multiplied by ``factor(s)`` from step ``step`` on (and
    whose own schedule, if any, runs under it): the run that used the new value from there."""
    spec = TASKS[task]

    def build(options: Any, data: Any, run: Any) -> Any:
        parts = spec.build(options, data, run)
        own = parts.scheduler.lr_lambdas[0] if parts.scheduler is not None else (lambda s: 1.0)
        parts.scheduler = torch.optim.lr_scheduler.LambdaLR(
            parts.optimizer, lambda s: own(s) if s < step else factor(s)
        )
        return parts

    return replace(spec, build=build)


CASES = {
    # the new --lr, the rest as it was
    "charlm-lr": (
        "charlm",
        ["--lr=1e-3"],
        ["--lr=4e-4"],
        lambda s: warmup_cosine(4, 40, 0.1)(s) * 0.4,
        {"lr": {"old": 1e-3, "new": 4e-4}},
    ),
    # a shorter schedule: its decay from the next step
    "charlm-schedule": (
        "charlm",
        ["--decay-steps=40"],
        ["--decay-steps=12"],
        warmup_cosine(4, 12, 0.1),
        {"decay_steps": {"old": 40, "new": 12}},
    ),
    # no scheduler: the optimizer's rate itself
    "cifar-lr": (
        "cifar",
        ["--lr=0.05"],
        ["--lr=0.0125"],
        lambda s: 0.25,
        {"lr": {"old": 0.05, "new": 0.0125}},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_changed_setting_on_resume_is_logged_and_used_from_the_next_step(
    case: str, data: dict[str, Path], tmp_path: Path
) -> None:
    task, before, after, factor, changed = CASES[case]
    full = flags(task, *before, f"--max-steps={MAX_STEPS}")
    reference, code = run_here(
        tmp_path / "reference", data[task], full, spec=switching_at(task, CHANGED_AT, factor)
    )
    assert code == OK
    expected = final_parameters(tmp_path / "reference" / "durable")
    unchanged = tmp_path / "unchanged"
    assert run_here(unchanged, data[task], full)[1] == OK
    # The change matters: a run that kept the old value ends elsewhere.
    assert matches(unchanged, expected) > 1e-6

    first = flags(task, *before, f"--max-steps={CHANGED_AT}")
    assert run_here(tmp_path / "run", data[task], first)[1] == OK
    resumed, code = run_here(
        tmp_path / "run", data[task], flags(task, *after, f"--max-steps={MAX_STEPS}")
    )
    assert code == OK
    (event,) = resumed.events(SETTINGS_CHANGED)
    assert (event["step"], event["changed"]) == (CHANGED_AT, changed)  # and nothing else
    (resumed_at,) = resumed.events(RESUMED)
    assert resumed_at["step"] == CHANGED_AT
    assert matches(tmp_path / "run", expected) < TOLERANCE


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_a_changed_model_shape_is_still_refused(
    parallelism: str, data: dict[str, Path], tmp_path: Path
) -> None:
    # The durable checkpoint's shapes are not this model's: refused with the setting that
    # differs, read from the checkpoint's identity, not with DCP's size mismatch.
    args = flags("charlm", f"--parallelism={parallelism}")
    assert run_here(tmp_path, data["charlm"], [*args, "--max-steps=2"])[1] == OK
    with pytest.raises(ConfigError, match="written with n_embd=16; this run has n_embd=32"):
        run_here(tmp_path, data["charlm"], [*args, "--n-embd=32", "--max-steps=4"])


def test_init_from_starts_at_step_0_from_another_runs_newest_weights(
    data: dict[str, Path], tmp_path: Path
) -> None:
    source = tmp_path / "source"
    assert run_here(source, data["charlm"], flags("charlm", "--max-steps=5"))[1] == OK
    weights = final_parameters(source / "durable")
    args = flags("charlm", f"--init-from={source / 'durable'}", "--max-steps=2")
    with one_process_world():
        h = harness(tmp_path / "new", data["charlm"], *args, tiny=())
        h.trainer.restore()
        live = {f"model.model.{k}": v for k, v in h.trainer.model.state_dict().items()}
        assert max_abs_difference(live, weights) == 0.0
        assert h.trainer.state.step == 0 and not h.trainer.optimizer.state  # fresh
        (initialized,) = h.events(INITIALIZED)
        assert initialized["from_step"] == 5
    new, code = run_here(tmp_path / "new", data["charlm"], args)
    assert code == OK
    (resumed,) = new.events(RESUMED)
    assert (resumed["source"], resumed["step"]) == ("fresh", 0)
    assert new.durable.head().step == 2  # its own steps, from 0
    # Its next round resumes its own state, not the other run's weights again.
    again, code = run_here(tmp_path / "new", data["charlm"], [*args, "--max-steps=3"])
    assert code == OK and not again.events(INITIALIZED)
    assert again.events(RESUMED)[0]["step"] == 2


def test_init_from_a_model_of_another_shape_is_one_line(
    data: dict[str, Path], tmp_path: Path
) -> None:
    source = tmp_path / "source"
    assert run_here(source, data["charlm"], flags("charlm", "--max-steps=1"))[1] == OK
    args = flags("charlm", f"--init-from={source / 'durable'}", "--n-embd=32")
    with pytest.raises(ConfigError, match="its model does not fit this task's .*Size mismatch"):
        run_here(tmp_path / "new", data["charlm"], args)


def test_init_from_a_uri_with_no_checkpoint_is_one_line(
    data: dict[str, Path], tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as raised:
        run_here(tmp_path, data["charlm"], flags("charlm", f"--init-from={empty}"))
    assert str(raised.value).startswith(f"--init-from (or TRAIN_INIT_FROM) {empty}: no ")


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_train_exits_2_for_init_from_a_uri_with_no_checkpoint(
    data: dict[str, Path], tmp_path: Path, parallelism: str
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "training.train", *flags("charlm")]
        + [f"--parallelism={parallelism}"]
        + [f"--data-dir={data['charlm']}", f"--checkpoint-uri={tmp_path / 'durable'}"]
        + [f"--local-dir={tmp_path / 'local'}", f"--init-from={empty}"],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == BAD_INPUT, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "--init-from" in line]
    assert len(lines) == 1 and "no checkpoint there to start from" in lines[0]
