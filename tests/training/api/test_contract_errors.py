"""A task that breaks the contract in its shape ends the worker before it joins, with one line
that names the field, and exit 2: an option named like a loop flag, training samples without a
``digest``, a ``digest`` that is not a str. ``--help`` with a task says what its --data-dir is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.loop.config import ConfigError, parse_config
from training.loop.inputs import load_data

REPO = Path(__file__).resolve().parents[3]
TASKS = '''
import hashlib
from dataclasses import dataclass

import torch

from training.api import Data, TrainParts, TrainSpec


@dataclass
class Shadowing:
    lr: float = 0.1
    """The task's own learning rate: the loop has one."""


@dataclass
class Fine:
    width: int = 2
    """Units."""


class NoDigest:
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.zeros(2)


class IntDigest(NoDigest):
    digest = 12345


class BytesDigest(NoDigest):
    digest = hashlib.sha256(b"points").digest()


def build(options, data, run):
    model = torch.nn.Linear(2, 1)
    return TrainParts(model, torch.optim.SGD(model.parameters(), lr=run.lr))


def collate(items, where):
    return torch.stack(items)


def loss(model, batch, where):
    return model(batch).sum()


shadowing = TrainSpec("s", Shadowing, lambda d, o: Data(train=IntDigest()), build, collate, loss)
no_digest = TrainSpec("n", Fine, lambda d, o: Data(train=NoDigest()), build, collate, loss)
int_digest = TrainSpec("i", Fine, lambda d, o: Data(train=IntDigest()), build, collate, loss)
bytes_digest = TrainSpec("b", Fine, lambda d, o: Data(train=BytesDigest()), build, collate, loss)
'''


@pytest.fixture
def tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "badtasks.py").write_text(TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("badtasks", None)


def _config(task: str) -> object:
    return parse_config([f"--task=badtasks:{task}", "--data-dir=/d", "--checkpoint-uri=/c"], {})


@pytest.mark.usefixtures("tasks")
def test_an_option_named_like_a_loop_flag_is_one_line_naming_both() -> None:
    with pytest.raises(ConfigError) as raised:
        _config("shadowing")
    message = str(raised.value)
    assert "option 'lr' of Shadowing is named like the loop's own flag --lr" in message
    assert "\n" not in message


@pytest.mark.usefixtures("tasks")
@pytest.mark.parametrize(
    ("task", "said"),
    [
        ("no_digest", "Data.train (NoDigest) has no digest: give it a property digest -> str"),
        ("int_digest", "Data.train.digest must be a non-empty str (a SHA-256 hex digest of the"),
        ("bytes_digest", "got bytes (hashlib's .hexdigest() is the str, .digest() the bytes)"),
    ],
)
def test_samples_without_a_digest_str_are_one_line_naming_the_field(task: str, said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_data(_config(task))  # type: ignore[arg-type]
    assert said in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.usefixtures("processes")
def test_train_exits_2_with_one_line_naming_the_field(tasks: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "training.train", "--task=badtasks:int_digest"]
        + [f"--data-dir={tasks}", f"--checkpoint-uri={tasks / 'durable'}"],
        cwd=REPO,
        env={"PYTHONPATH": os.pathsep.join([str(REPO), str(tasks)]), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "digest" in line]
    assert len(lines) == 1 and "Data.train.digest must be a non-empty str" in lines[0]
    assert "Traceback" not in result.stderr


def test_help_with_a_task_says_what_its_data_dir_holds(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    with pytest.raises(SystemExit):
        parse_config(["--task=charlm", "--help"], {})
    lines = capsys.readouterr().out.splitlines()
    data_dir = next(line for line in lines if line.strip().startswith("--data-dir "))
    assert "charlm: ``input.txt`` in ``data_dir``, split 90/10" in data_dir
