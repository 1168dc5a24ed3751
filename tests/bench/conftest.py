"""The end-to-end runs of ``python -m bench`` (the chaos campaign's smoke, the whole bench's
smoke) start together, as soon as the first of them is needed.

Each run is mostly paced training and waiting for processes to start and stop, so the two side
by side on two cores take little longer than the longer one alone, where one after the other
they took both. A test module that needs a run says how to start it (``bench_command``: the
command line for an output dir, and its time limit); its fixture waits for the run's end
(``bench_runs[module name].finished()``). Only the runs of the modules selected start.

With workers (pytest-xdist), every test of these modules is ``heavy`` (tests/support/tiers.py),
so they all run on one worker and start there together. A worker that may get only some of them
(a ``--dist`` mode that keeps no group together) starts each run when its module asks for it,
so no run is started twice.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

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


class BenchRuns:
    """The runs by module name, each started once: up front, or when its module asks for it."""

    def __init__(self, modules: list[ModuleType], factory: pytest.TempPathFactory) -> None:
        self._modules = {module.__name__: module for module in modules}
        self._factory = factory
        self._runs: dict[str, BenchRun] = {}

    def start(self, name: str) -> BenchRun:
        if name not in self._runs:
            root = self._factory.mktemp(name.rsplit(".", 1)[-1])
            command, timeout_s = self._modules[name].bench_command(root / "out")
            self._runs[name] = BenchRun.start(root, command, timeout_s)
        return self._runs[name]

    def __getitem__(self, name: str) -> BenchRun:
        return self.start(name)

    def stop(self) -> None:
        for run in self._runs.values():  # a run no test waited for (its module failed before)
            run.stop()


def _all_on_this_process(config: pytest.Config) -> bool:
    """Whether every selected test of these modules runs in this process: no workers, or
    workers that keep a group on one (``heavy``)."""
    return not hasattr(config, "workerinput") or bool(config.getvalue("loadgroup"))


@pytest.fixture(scope="session")
def bench_runs(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    torchrun: None,
    heavy: None,
) -> Iterator[BenchRuns]:
    """Every selected module's run, all started at once (see above); keyed by module name."""
    modules = {item.module for item in request.session.items if getattr(item, "module", None)}
    with_runs = sorted(
        (m for m in modules if hasattr(m, "bench_command")), key=lambda m: m.__name__
    )
    runs = BenchRuns(with_runs, tmp_path_factory)
    if _all_on_this_process(request.config):
        for module in with_runs:
            runs.start(module.__name__)
    yield runs
    runs.stop()
