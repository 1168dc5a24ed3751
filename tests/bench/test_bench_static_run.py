"""The static run's torchrun dies with the benchmark, without a preexec_fn: the benchmark's
CPU sampling thread runs while it forks, and CPython documents preexec_fn as unsafe then."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab.local.process_tree import dying_with_this_process
from tests.support.waiting import wait_until

pytestmark = pytest.mark.usefixtures("processes")

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for whoever adopted it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_the_command_gets_sigterm_when_the_process_that_started_it_is_killed() -> None:
    # A stand-in for the benchmark: it starts the wrapped command with a thread running,
    # says the command's pid, and waits to be killed.
    bench = textwrap.dedent(
        """
        import subprocess, sys, threading
        from lab.local.process_tree import dying_with_this_process
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        command = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"]
        child = subprocess.Popen(
            dying_with_this_process(command, sys.executable),
            stdout=sys.stdout,
            start_new_session=True,
        )
        print(child.pid, flush=True)
        child.wait()
        """
    )
    stand_in = subprocess.Popen(
        [sys.executable, "-c", bench], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert stand_in.stdout is not None
        # Its pid and the command's "ready" (the command itself runs now), in either order.
        lines = {stand_in.stdout.readline().strip() for _ in range(2)}
        assert "ready" in lines, lines
        (pid,) = (int(line) for line in lines - {"ready"})
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"time.sleep(60)" in b" ".join(cmdline)  # exec'd in place: the same pid
        stand_in.send_signal(signal.SIGKILL)
        stand_in.wait()
        wait_until(lambda: _gone(pid), 30, "the command to die with the process that started it")
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()


def test_a_command_whose_parent_died_before_it_armed_the_signal_does_not_run(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran"
    command = dying_with_this_process(["touch", str(marker)], sys.executable)
    command[command.index(str(os.getpid()))] = "1"  # as if adopted: the parent is gone
    assert subprocess.run(command).returncode == 128 + signal.SIGTERM
    assert not marker.exists()
