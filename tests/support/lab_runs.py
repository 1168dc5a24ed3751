"""Commands as a user runs them: ``python -m lab run`` (a scenario file in, its report out), and
a fresh Python for the tests of what a command imports or prints at its start."""

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
