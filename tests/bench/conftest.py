"""The end-to-end runs of ``python -m bench`` (the chaos campaign's smoke, the whole bench's
smoke) start together, as soon as the first of them is needed.

Each run is mostly paced training and waiting for processes to start and stop, so the two side
by side on two cores take little longer than the longer one alone, where one after the other
they took both. A test module that needs a run says how to start it (``bench_command``: the
command line for an output dir, and its time limit); its fixture waits for the run's end
(``bench_runs[module name].finished()``). Only the runs of the modules selected start.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class BenchRun:
    """One ``python -m bench ...`` started in the background, its output going to files."""

    command: list[str]
    out: Path
    """The run's --out."""
    logs: Path
    process: subprocess.Popen[bytes]
    deadline: float

    @classmethod
    def start(cls, root: Path, command: list[str], timeout_s: float) -> BenchRun:
        logs = root / "logs"
        logs.mkdir(parents=True)
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=err)
        return cls(command, root / "out", logs, process, time.monotonic() + timeout_s)

    def finished(self) -> subprocess.CompletedProcess[str]:
        """Wait for the run's end (at most until its time limit); its code and output."""
        try:
            code = self.process.wait(max(self.deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"{' '.join(self.command[1:])} did not end in its time:\n"
                f"{(self.logs / 'stderr').read_text(errors='replace')[-3000:]}"
            ) from None
        return subprocess.CompletedProcess(
            self.command,
            code,
            (self.logs / "stdout").read_text(errors="replace"),
            (self.logs / "stderr").read_text(errors="replace"),
        )

    def stop(self) -> None:
        """SIGTERM (the command stops everything it started), SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def bench_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, torchrun: None
) -> Iterator[dict[str, BenchRun]]:
    """Every selected module's run, all started at once; keyed by the module's name."""
    modules = {item.module for item in request.session.items if getattr(item, "module", None)}
    runs: dict[str, BenchRun] = {}
    for module in sorted(modules, key=lambda m: m.__name__):
        make = getattr(module, "bench_command", None)
        if make is None:
            continue
        root = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
        command, timeout_s = make(root / "out")
        runs[module.__name__] = BenchRun.start(root, command, timeout_s)
    yield runs
    for run in runs.values():  # a run no test waited for (its module failed before)
        run.stop()
