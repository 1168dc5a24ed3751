"""A task from the user's own module (``--task package.module:attribute``): trained by the
real Trainer from a package outside ``training/``, and refused with one line naming ``--task``
when it does not import or is not a TrainSpec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.exactness import run_here
from tests.support.trainer_harness import saved_checkpoint
from tests.training.tasks.user_package import REFERENCE, user_package_on_path, write_user_package
from training.checkpoints.sharded.state import unpack
from training.elastic.exit_codes import BAD_INPUT, OK
from training.loop.config import ConfigError, parse_config
from training.records import METRICS, RESUMED
from training.tasks import TASKS, is_task_reference

REPO_ROOT = Path(__file__).resolve().parents[3]
ARGS = [f"--task={REFERENCE}", "--global-batch-size=8", "--micro-batch-size=4", "--lr=0.05"]


@pytest.mark.parametrize(
    ("name", "shaped"),
    [
        ("my_package.my_module:spec", True),
        ("pkg:SPEC", True),
        ("a.b:c.d", True),
        ("charlm", False),
        ("pkg:", False),
        (":spec", False),
        ("pkg.:spec", False),
        ("pkg:spec:x", False),
        ("my-package:spec", False),
    ],
)
def test_a_reference_is_known_by_its_shape(name: str, shaped: bool) -> None:
    assert is_task_reference(name) is shaped
    assert (name in TASKS) is (shaped or name == "charlm")


def test_a_task_from_the_users_own_package_trains_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with user_package_on_path(tmp_path / "src", monkeypatch):
        first, code = run_here(tmp_path, tmp_path, [*ARGS, "--max-steps=30", "--log-every=1"])
        assert code == OK
        assert first.trainer.spec.name == "line"
        assert type(first.trainer.cfg.options).__module__ == "userpkg.line"
        losses = [r["loss"] for r in _metrics(first)]
        assert losses[-1] < losses[0] / 10  # it learned the line
        second, code = run_here(tmp_path, tmp_path, [*ARGS, "--max-steps=35", "--width=3"])
        assert code == OK
    (resumed,) = second.events(RESUMED)
    assert (resumed["source"], resumed["step"]) == ("durable", 30)
    saved = saved_checkpoint(tmp_path / "durable")
    assert saved["step"] == 35 and unpack(saved["run"])["task"] == REFERENCE


@pytest.mark.parametrize(
    ("task", "found"),
    [
        ("nosuch:spec", "cannot import module 'nosuch': ModuleNotFoundError"),
        ("userpkg.line:nope", "module 'userpkg.line' has no attribute 'nope'"),
        ("userpkg.line:not_a_spec", "is a builtins.int, not a training.api.TrainSpec"),
        ("json:dumps", "json:dumps is a builtins.function, not a training.api.TrainSpec"),
        ("no/such", "must be one of charlm, cifar or a TrainSpec of your own module as"),
    ],
)
def test_a_task_that_is_no_trainspec_is_one_line_naming_the_flag(
    task: str, found: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        user_package_on_path(tmp_path, monkeypatch),
        pytest.raises(ConfigError) as raised,
    ):
        parse_config([f"--task={task}", "--data-dir=/d", "--checkpoint-uri=/c"], env={})
    message = str(raised.value)
    assert message.startswith("--task (or TRAIN_TASK)")
    assert found in message and "\n" not in message


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize(
    ("task", "found"),
    [
        ("nosuch:spec", "cannot import module 'nosuch'"),
        ("userpkg.line:not_a_spec", "not a training.api.TrainSpec"),
    ],
)
def test_train_exits_2_with_one_line_for_a_task_that_does_not_load(
    task: str, found: str, tmp_path: Path
) -> None:
    user = write_user_package(tmp_path / "src")
    result = subprocess.run(
        [sys.executable, "-m", "training.train", f"--task={task}"]
        + [f"--data-dir={tmp_path}", f"--checkpoint-uri={tmp_path / 'durable'}"],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(user)]), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == BAD_INPUT, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "--task" in line]
    assert len(lines) == 1 and found in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def _metrics(h: object) -> list[dict]:
    import json

    stream = h.stream  # type: ignore[attr-defined]
    return [r for r in map(json.loads, stream.getvalue().splitlines()) if r["kind"] == METRICS]
