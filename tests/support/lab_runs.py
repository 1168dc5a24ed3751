"""Commands as a user runs them: ``python -m lab run`` (a scenario file in, its report out), and
a fresh Python for the tests of what a command imports or prints at its start; the processes a
lab run left behind, found by its rendezvous id or its workspace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_lab(scenario: Path, out: Path, timeout_s: float = 300) -> dict[str, Any]:
    """The report of a lab run that must succeed (exit 0); its output on failure."""
    result = subprocess.run(
        [sys.executable, "-m", "lab", "run", "--scenario", str(scenario), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def fresh_python(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a new interpreter at the repo's root, with only the repo on its path
    and no environment of this process (so nothing this pytest loaded is taken for granted)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


REPLY = "lab-command-done: "
# Runs ``python -m lab ARGS`` as runpy does for ``-m``, once per request line (JSON: args,
# cwd), and answers on the real stdout with what the command printed and its exit code: what
# the interpreter makes of a SystemExit or an uncaught exception, as a fresh process would.
SERVE = f"""
import contextlib, io, json, os, runpy, sys, traceback
for request in sys.stdin:
    request = json.loads(request)
    os.chdir(request["cwd"])
    sys.argv = ["-m", *request["args"]]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("lab", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    answer = {{"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}}
    sys.__stdout__.write({REPLY!r} + json.dumps(answer) + "\\n")
    sys.__stdout__.flush()
"""


class LabCommands:
    """``python -m lab ARGS`` run one after another in one fresh Python (the environment of
    ``fresh_python``): the exit code and output of each, as its own process gives them, for
    tests of commands that are refused before they start anything. A command that must load
    torch to check its input then pays for the import once, not once per test."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", SERVE],
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        """``python -m lab ARGS`` in ``cwd``: its exit code, stdout and stderr."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps({"args": list(args), "cwd": str(cwd)}) + "\n")
        self._process.stdin.flush()
        for line in self._process.stdout:
            if line.startswith(REPLY):  # anything else is a child's output on the shared fd
                answer = json.loads(line.removeprefix(REPLY))
                return subprocess.CompletedProcess(
                    ["python", "-m", "lab", *args],
                    answer["code"],
                    answer["stdout"],
                    answer["stderr"],
                )
        raise AssertionError(f"python -m lab {' '.join(args)} ended its interpreter")

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _processes_of_the_run(rdzv_id: str, workspace: str) -> list[int]:
    """Live processes whose env holds the run's rendezvous id, or whose env or command
    line mentions its workspace."""
    markers = (f"PET_RDZV_ID={rdzv_id}".encode(), workspace.encode())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            text = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if any(marker in text for marker in markers):
            found.append(int(proc.name))
    return found
