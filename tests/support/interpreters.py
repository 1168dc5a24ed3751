"""A fresh Python for the tests that check what a command imports or prints at its start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def fresh_python(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a new interpreter at the repo's root, with only the repo on its path
    and no environment of this process (so nothing this pytest loaded is taken for granted)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
