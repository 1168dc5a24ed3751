"""The settings the stack, the lab and the job share live in ``training/settings.py``: torch-free,
read by the stack's config instead of the trainer's flag module, and the same the flags check."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from training import python_source, settings
from training.loop import config as flags

PROJECT_DIR = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("processes")
def test_the_shared_settings_import_no_torch() -> None:
    # A fresh interpreter: this one may have torch imported already.
    code = (
        "import sys, training.settings; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _imported_modules(path: Path) -> set[str]:
    tree = python_source.parse(path.read_text(), str(path))
    return {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }


def test_the_stack_config_reads_the_trainers_choices_from_the_shared_settings() -> None:
    """Only ``train_args.py`` reads the loop's flags, to check ``trainArgs`` against them."""
    readers = {
        path.name
        for path in (PROJECT_DIR / "stack_config").glob("*.py")
        if any(m.startswith("training.loop") for m in _imported_modules(path))
    }
    assert readers == {"train_args.py"}


def test_the_flags_check_the_shared_choices() -> None:
    assert flags.PRECISIONS is settings.PRECISIONS
    assert flags.PARALLELISMS is settings.PARALLELISMS
