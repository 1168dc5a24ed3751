"""``python -m lab``: bad input is refused before anything starts, with the flag named."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.lab_runs import LabCommands

REPO_ROOT = Path(__file__).resolve().parents[2]


def lab(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lab", *args],
        cwd=cwd,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def refused(processes: None) -> Iterator[LabCommands]:
    """``lab run`` with bad input, each test's command in one shared Python: its checks load
    torch (training's own validation), about 2 s a process. The other tests here spawn
    ``python -m lab`` as a user does."""
    commands = LabCommands()
    yield commands
    commands.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--fault", "kind=explode,at_step=3"],
            "unknown fault kind 'explode'; allowed: kill, evict",
        ),
        (["--fault", "kind=kill,node=9,at_step=3"], "cannot kill node 9"),
        (
            ["--fault", "kind=join,at_step=100000"],
            "at_step: 100000 is out of range; allowed: 1..399",
        ),
        (
            ["--etcd-binary", "/nonexistent/etcd"],
            "--etcd-binary: /nonexistent/etcd is not an executable",
        ),
        (["--data-dir", "/nonexistent/cifar"], "--data-dir: /nonexistent/cifar does not exist"),
        (
            ["--scenario", "nope"],
            "--scenario: 'nope' is neither a built-in scenario (default, ci, charlm)",
        ),
        (["--nodes", "5"], "nodes: 5 must be within min_nodes..max_nodes (1..3)"),
        (
            ["--fault", "node=1,at_step=3"],
            "--fault[0].kind: required; allowed: kill, evict, freeze, join, etcd-restart, kill-all",
        ),
        (["--fault", "kind=kill,node=one,at_step=3"], "--fault[0].node: expected int, got 'one'"),
        (["--max-steps", "0"], "--max-steps: must be >= 1, got 0"),
        (["--fault", "kind=kill-all,nodes=4,at_step=3"], "more than max_nodes 3; allowed: 1..3"),
    ],
)
@pytest.mark.usefixtures("processes")
def test_bad_input_exits_2_and_names_the_setting(
    refused: LabCommands, tmp_path: Path, args: list[str], message: str
) -> None:
    scenario = [] if "--scenario" in args else ["--ci"]
    result = refused.run("run", *scenario, "--out", str(tmp_path / "out"), *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was started or written


@pytest.mark.usefixtures("processes")
def test_an_existing_run_dir_is_not_reused(refused: LabCommands, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    result = refused.run("run", "--ci", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2
    assert f"--out: {out} already exists and is not empty" in result.stderr
    assert [p.name for p in out.iterdir()] == ["report.json"]


@pytest.mark.usefixtures("processes")
def test_an_out_dir_that_cannot_be_created_names_the_flag(
    refused: LabCommands, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "out"
    result = refused.run("run", "--ci", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"error: --out: cannot create {out}: Not a directory" in result.stderr


@pytest.mark.usefixtures("processes")
def test_simulate_eviction_is_dispatched(tmp_path: Path) -> None:
    result = lab("simulate-eviction", "--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "simulate-eviction" in result.stdout


@pytest.mark.usefixtures("processes")
def test_scenarios_lists_both_builtins(tmp_path: Path) -> None:
    result = lab("scenarios", cwd=tmp_path)
    assert result.returncode == 0
    assert "default: 3 nodes" in result.stdout and "ci: 3 nodes" in result.stdout
    assert "kill-all, start 2 new @ step 150" in result.stdout


@pytest.mark.usefixtures("processes")
def test_unknown_command_is_an_argparse_error(tmp_path: Path) -> None:
    result = lab("explode", cwd=tmp_path)
    assert result.returncode == 2
    assert "invalid choice: 'explode'" in result.stderr


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("nodes = [1]\n", "error: nodes: expected int, got [1] (allowed: an integer)"),
        ("[train]\nlr = 0.0\n", "error: train.lr: must be > 0, got 0.0"),
        ("[[faults]]\nnode = 1\nat_step = 3\n", "error: faults[0].kind: required; allowed:"),
        ("[train\n", "error: --scenario: "),
    ],
)
@pytest.mark.usefixtures("processes")
def test_a_bad_scenario_file_exits_2_and_names_the_key(
    refused: LabCommands, tmp_path: Path, toml: str, message: str
) -> None:
    (tmp_path / "bad.toml").write_text(toml)
    result = refused.run(
        "run", "--scenario", "bad.toml", "--out", str(tmp_path / "out"), cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"readme.txt": b"hi"}, "--data-dir: no train batch files (data_batch_1.bin"),
        ({"data_batch_1.bin": b"\x00" * 100}, "not a multiple of the 3073-byte record"),
        ({"data_batch_1.bin": b"\x00" * 3073}, "holds 1 training samples; allowed: >= "),
    ],
)
@pytest.mark.usefixtures("processes")
def test_a_data_dir_the_loader_cannot_read_is_refused(
    refused: LabCommands, tmp_path: Path, files: dict[str, bytes], message: str
) -> None:
    data = tmp_path / "cifar"
    data.mkdir()
    for name, content in files.items():
        (data / name).write_bytes(content)
    out = str(tmp_path / "out")
    result = refused.run("run", "--ci", "--out", out, "--data-dir", str(data), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("etcd Version: 3.4.23", "is etcd 3.4.23; allowed: etcd 3.5 or 3.6"),
        ("etcd Version: 3.7.0", "is etcd 3.7.0; allowed: etcd 3.5 or 3.6"),
        ("hello", "--version does not print an etcd version; allowed: etcd 3.5 or 3.6"),
    ],
)
@pytest.mark.usefixtures("processes")
def test_an_etcd_outside_the_supported_minors_is_refused(
    refused: LabCommands, tmp_path: Path, version: str, message: str
) -> None:
    fake = tmp_path / "etcd"
    fake.write_text(f"#!/bin/sh\necho '{version}'\n")
    fake.chmod(0o755)
    out = str(tmp_path / "out")
    result = refused.run("run", "--ci", "--out", out, "--etcd-binary", str(fake), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"--etcd-binary: {fake} {message}" in result.stderr
    assert not (tmp_path / "out").exists()


COMMANDS = ["run", "scenarios", "report", "watch", "drill", "rebalance", "preflight", "prices"]


@pytest.mark.parametrize(
    "command", [[], *([c] for c in COMMANDS)], ids=lambda c: c[0] if c else "lab"
)
@pytest.mark.usefixtures("processes")
def test_every_help_has_one_layout(tmp_path: Path, command: list[str]) -> None:
    """argparse's layout wrapped to the terminal, with the exit statuses as their own line."""
    result = subprocess.run(
        [sys.executable, "-m", "lab", *command, "--help"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "80"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(" ".join(["usage: python -m lab", *command]))
    assert [line for line in lines if line.startswith("Exit status: 0 ")], result.stdout
    too_wide = [line for line in lines if len(line) > 80 and not line.startswith(" ")]
    assert not too_wide  # an indented line may be a long choice list argparse does not wrap


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["report", "--logs", ".", "--spot-price", "-1"], "--spot-price must be > 0, got -1.0"),
        (["report", "--logs", ".", "--max-steps", "0"], "--max-steps must be > 0, got 0"),
        (["drill", "--evict", "0"], "--evict must be a count >= 1, got 0"),
        (["drill", "--interval", "nan"], "--interval must be seconds >= 0, got nan"),
        (["drill", "--recover-timeout", "0"], "--recover-timeout must be seconds > 0, got 0.0"),
        (["rebalance", "--poll", "inf"], "--poll must be seconds > 0, got inf"),
        (["watch", "--stack-outputs"], "argument --stack-outputs: expected one argument"),
        (["prices", "--hours", "0"], "--hours must be a number of hours > 0, got 0"),
        (["prices", "--vm-size", "x"], "--vm-size must be one of Standard_NC4as_T4_v3, "),
    ],
)
@pytest.mark.usefixtures("processes")
def test_bad_input_is_one_line_naming_the_flag_exit_2(
    tmp_path: Path, args: list[str], line: str
) -> None:
    """The same wording in every command: the flag, what it allows, what it got."""
    outputs = ["--stack-outputs", str(tmp_path / "none.json")]
    cluster = args[0] in ("drill", "rebalance")
    result = lab(*args, *(outputs if cluster else []), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    said = [text for text in result.stderr.splitlines() if "error: " in text]
    assert len(said) == 1 and line in said[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "lab-runs").exists()  # refused before anything was written
