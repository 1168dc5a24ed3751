"""``python -m lab`` answers at once: ``--help``, and a flag's check, load neither torch nor the
Azure or Kubernetes clients, nor numpy or matplotlib; a command loads them when it runs.

A test of what is imported (``sys.modules`` as the process exits), not of how long it takes: a
loaded machine makes any time meaningless. ``python -X importtime -m lab --help`` shows the
time.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.lab_runs import fresh_python

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "azure", "kubernetes", "matplotlib")
"""Top-level packages a command's help must not import."""
MARK = "imported modules: "
# Runs ``python -m lab ARGS`` as runpy does for ``-m``, and says on exit (a SystemExit included)
# every module loaded: sys.modules holds those that importlib.import_module loaded too.
RUN_AND_LIST = f"""
import atexit, json, runpy, sys
atexit.register(lambda: print({MARK!r} + json.dumps(sorted(sys.modules)), file=sys.stderr))
"""


def run_python(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python ARGS`` (``-m lab ...`` or ``-c CODE``); the result and every module loaded."""
    if args[0] == "-m":
        code = f"{RUN_AND_LIST}sys.argv = ['-m', *{list(args[2:])!r}]\n"
        code += f"runpy.run_module({args[1]!r}, run_name='__main__', alter_sys=True)\n"
    else:
        code = RUN_AND_LIST + args[1]
    result = fresh_python("-c", code, timeout_s=120)
    listed = [line for line in result.stderr.splitlines() if line.startswith(MARK)]
    assert listed, result.stderr
    return result, set(json.loads(listed[-1].removeprefix(MARK)))


def heavy_among(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.usefixtures("processes")
def test_the_listing_sees_a_heavy_import() -> None:
    """A heavy import shows: the other tests can fail."""
    result, modules = run_python("-c", "import numpy")
    assert result.returncode == 0, result.stderr
    assert "numpy" in heavy_among(modules)


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["run"],
        ["report"],
        ["preflight"],
        ["prices"],
        ["watch"],
        ["drill"],
        ["rebalance"],
    ],
    ids=lambda command: " ".join(command) or "lab",
)
@pytest.mark.usefixtures("processes")
def test_help_loads_no_heavy_package(command: list[str]) -> None:
    result, modules = run_python("-m", "lab", *command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m lab")
    assert "lab.cli" in modules
    assert heavy_among(modules) == []


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["prices", "--hours", "0"], "--hours must be"),
        (["prices", "--vm-size", "Standard_Nope"], "--vm-size must be one of"),
        (["preflight", "--nope"], "unrecognized arguments: --nope"),
        (["run", "--nodes", "x"], "argument --nodes: invalid int value: 'x'"),
    ],
)
@pytest.mark.usefixtures("processes")
def test_bad_flags_are_refused_before_a_heavy_package_loads(
    command: list[str], message: str
) -> None:
    result, modules = run_python("-m", "lab", *command)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert heavy_among(modules) == []


@pytest.mark.usefixtures("processes")
def test_a_command_that_needs_torch_still_loads_it() -> None:
    """The tasks load on first use: a check of the training flags imports what it checks."""
    code = (
        "from training.loop.config import parse_config;"
        "parse_config(['--data-dir=d', '--checkpoint-uri=c', '--task=charlm'], env={})"
    )
    result, modules = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert {"torch", "training.tasks.charlm"} <= modules
    assert "training.tasks.cifar" not in modules  # only the task named


@pytest.mark.usefixtures("processes")
def test_the_training_config_loads_without_torch() -> None:
    result, modules = run_python("-c", "import training.loop.config, lab.local.scenario")
    assert result.returncode == 0, result.stderr
    assert heavy_among(modules) == []
