"""Every command of docs/your-own-model.md's sections on a run of the user's own package (under
torchrun; its data in, its weights and history out), run as written: in a directory holding
the package (``my-repo``) and its data, with Azurite as the stack's data container and a fake
``pulumi`` printing the stack's outputs."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lab.cli import main
from tests.support.lab_azure_fixtures import fake_pulumi
from tests.support.user_package import write_user_data, write_user_package

pytestmark = pytest.mark.usefixtures("torchrun")

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "your-own-model.md"


def documented_commands() -> list[str]:
    """The shell commands (fences without a language) of the two sections, in order, their
    continuation lines joined."""
    text = DOC.read_text()
    section = text[text.index("**Under torchrun.**") : text.index("## Changing settings")]
    commands, fence = [], None
    for line in section.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:]
        elif fence == "" and line.strip():
            if commands and commands[-1].endswith("\\"):
                commands[-1] = commands[-1][:-1] + line
            else:
                commands.append(line)
    return [" ".join(command.split()) for command in commands]


def test_the_documented_commands_run_as_written(
    azurite: str, azurite_account: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from azure.storage.blob import ContainerClient

    container = ContainerClient.from_connection_string(azurite, "data")
    if not container.exists():  # one Azurite for the session: another test may have made it
        container.create_container()
    write_user_package(tmp_path / "my-repo")
    write_user_data(tmp_path / "data")
    outputs = {
        "dataUri": f"{azurite_account}/data",
        "checkpointUri": str(tmp_path / "runs" / "mine"),
    }
    bin_dir = fake_pulumi(tmp_path / "bin", outputs)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    monkeypatch.chdir(tmp_path)
    commands = documented_commands()
    assert [c.split(" -m ")[1].split()[0] for c in commands] == [
        "training.train", "lab", "lab", "lab", "lab",
    ]  # fmt: skip
    for command in commands:
        env_part, _, run = command.partition(" torchrun ")
        if run:  # the one torchrun: its env prefix, the repo's root as "."
            env = dict(part.split("=", 1) for part in shlex.split(env_part))
            path = env["PYTHONPATH"].replace(".", str(REPO), 1).replace("my-repo", "./my-repo")
            torchrun = [sys.executable, "-m", "torch.distributed.run", *shlex.split(run)]
            done = subprocess.run(
                torchrun,
                env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
                     "TRAIN_LOCAL_DIR": str(tmp_path / "local")},
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            continue
        assert command.startswith(".venv/bin/python -m lab ")
        assert main(shlex.split(command.removeprefix(".venv/bin/python -m lab "))) == 0, command
    assert sorted(torch.load("model.pt", weights_only=True)) == sorted(
        load_file("model.safetensors")
    )
    assert (tmp_path / "lab-runs" / "mine" / "report.json").exists()
