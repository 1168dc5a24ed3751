"""``python -m lab run`` as a user runs it: a scenario file in, its report out."""

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
