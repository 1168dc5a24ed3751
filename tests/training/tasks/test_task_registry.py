"""The task registry: its names without importing the tasks, each name its spec's, and
``python -m training.train --help`` listing them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.lab_runs import fresh_python
from training.tasks import DEFAULT_TASK, SHARDABLE_TASKS, TASK_NAMES, TASKS

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_each_name_is_its_specs_name() -> None:
    assert TASK_NAMES == tuple(sorted(TASKS)) == ("charlm", "cifar")
    assert DEFAULT_TASK in TASK_NAMES
    for name in TASK_NAMES:
        assert TASKS[name].name == name
    assert len(TASKS) == len(TASK_NAMES)


def test_the_shardable_tasks_are_those_whose_spec_can_be_sharded() -> None:
    specs = {name: TASKS[name] for name in TASK_NAMES}
    can = {n for n, s in specs.items() if s.parallelize is not None and s.init_weights}
    assert SHARDABLE_TASKS == can == {"charlm"}


def test_an_unknown_task_is_a_key_error() -> None:
    assert "gpt5" not in TASKS
    with pytest.raises(KeyError):
        TASKS["gpt5"]


@pytest.mark.usefixtures("processes")
def test_train_help_lists_the_tasks_by_name() -> None:
    result = fresh_python("-m", "training.train", "--help", timeout_s=300)
    assert result.returncode == 0, result.stderr
    names = ",".join(TASK_NAMES)
    assert f"[--task {{{names}}}]" in result.stdout  # the usage line
    # The option's own help, however argparse wraps it.
    text = " ".join(result.stdout.split())
    assert re.search(rf"--task {{{names}}} What to train: .* One of: charlm, cifar\.", text)


@pytest.mark.usefixtures("processes")
def test_the_fork_servers_preload_holds_every_task() -> None:
    """The warm launcher's fork server imports torch, then training.train: the tasks and their
    options' docs are loaded there once, not again by every forked worker after a restart."""
    code = (
        "import sys, torch, training.train\n"
        "from training.loop.config import _field_docs\n"
        "from training.tasks import TASK_NAMES\n"
        "print(all(f'training.tasks.{name}' in sys.modules for name in TASK_NAMES))\n"
        "print(_field_docs.cache_info().currsize)\n"
    )
    result = fresh_python("-c", code, timeout_s=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", str(1 + len(TASK_NAMES))]  # the config's, each task's
