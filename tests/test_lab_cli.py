"""``python -m lab``: bad input is refused before anything starts, with the flag named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def lab(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lab", *args],
        cwd=cwd,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


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
        (["--scenario", "nope"], "--scenario: 'nope' is neither a built-in scenario (default, ci)"),
        (["--nodes", "5"], "nodes: 5 must be within min_nodes..max_nodes (1..3)"),
    ],
)
def test_bad_input_exits_2_and_names_the_setting(
    tmp_path: Path, args: list[str], message: str
) -> None:
    scenario = [] if "--scenario" in args else ["--ci"]
    result = lab("run", *scenario, "--out", str(tmp_path / "out"), *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was started or written


def test_an_existing_run_dir_is_not_reused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    result = lab("run", "--ci", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2
    assert f"--out: {out} already exists and is not empty" in result.stderr
    assert [p.name for p in out.iterdir()] == ["report.json"]


def test_simulate_eviction_is_dispatched(tmp_path: Path) -> None:
    result = lab("simulate-eviction", "--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "simulate-eviction" in result.stdout


def test_scenarios_lists_both_builtins(tmp_path: Path) -> None:
    result = lab("scenarios", cwd=tmp_path)
    assert result.returncode == 0
    assert "default: 3 nodes" in result.stdout and "ci: 3 nodes" in result.stdout
    assert "kill-all, start 2 new @ step 150" in result.stdout


def test_unknown_command_is_an_argparse_error(tmp_path: Path) -> None:
    result = lab("explode", cwd=tmp_path)
    assert result.returncode == 2
    assert "invalid choice: 'explode'" in result.stderr
