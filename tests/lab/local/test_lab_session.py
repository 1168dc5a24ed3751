"""A session's setup and teardown without training: a failed setup leaves no output dir,
and the workspace goes only after every process that still uses it is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lab.local import process_tree
from lab.local.etcd_server import EtcdError
from lab.local.scenario_file import load_scenario
from lab.local.session import LabError, SessionOptions, run_session

REPO_ROOT = Path(__file__).resolve().parents[3]


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.mark.usefixtures("processes")
def test_a_failed_dataset_write_removes_the_out_dir_it_created(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "one"
    failing_python = _script(tmp_path / "python", "echo 'no space left' >&2\nexit 1\n")
    options = SessionOptions(out_dir=out, python=failing_python)
    for _ in range(2):  # a rerun with the same --out meets the same error, not "not empty"
        with pytest.raises(LabError, match="writing the synthetic dataset failed:\nno space"):
            run_session(load_scenario("ci"), options, None)
        assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("processes")
def test_an_etcd_that_does_not_start_leaves_an_empty_out_dir_empty(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    etcd = _script(
        tmp_path / "etcd",
        'if [ "$1" = --version ]; then echo "etcd Version: 3.5.9"; exit 0; fi\n'
        "echo 'bind: address already in use'\nexit 3\n",
    )
    writes_nothing = _script(tmp_path / "python", "exit 0\n")
    options = SessionOptions(out_dir=out, etcd_binary=etcd, python=writes_nothing)
    # The log is gone with the out dir, so the error carries its end.
    with pytest.raises(EtcdError, match="exited with code 3 at start:\nbind: address already"):
        run_session(load_scenario("ci"), options, None)
    assert out.is_dir() and list(out.iterdir()) == []


# Run in a child: a subreaper pytest would collect every orphan of every later test.
SWEEP = """
import json, os, subprocess, sys
from lab.local.session import lab_workspace

with lab_workspace() as work:
    # A worker left behind by a dead agent: an orphan that re-parents to us.
    shell = subprocess.Popen(
        ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(work / "tmp")}, start_new_session=True,
    )
    orphan = int(shell.stdout.readline())
    shell.wait()
    bystander = subprocess.Popen(["sleep", "300"])  # the caller's own child: not the lab's
    print(json.dumps({"work": str(work), "orphan": orphan, "bystander": bystander.pid}))
    sys.stdout.flush()
print(json.dumps({"bystander_alive": bystander.poll() is None}))
bystander.kill()
bystander.wait()
"""


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(60)
def test_the_workspace_goes_only_after_the_processes_that_use_it(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SWEEP)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, result.stderr
    inside, after = (json.loads(line) for line in result.stdout.splitlines())
    deadline = time.monotonic() + 5
    while process_tree.is_alive(inside["orphan"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = process_tree.is_alive(inside["orphan"])
    if survived:  # do not leave it behind when the test fails
        os.kill(inside["orphan"], signal.SIGKILL)
    assert not survived
    assert not Path(inside["work"]).exists()
    assert after["bystander_alive"]  # only what mentions the workspace is killed
