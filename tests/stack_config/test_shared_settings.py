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
def test_the_shared_settings_and_the_stack_config_import_no_torch_nor_the_flag_parser() -> None:
    # A fresh interpreter: this one may have torch imported already.
    code = (
        "import sys, training.settings, stack_config, stack_config.train_args; "
        "print(sorted(m for m in sys.modules if m in ('torch', 'training.loop.config') "
        "or m.startswith('torch.')))"
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
    """Only ``train_args.py`` reads the loop's settings, to check ``trainArgs`` against them,
    and from their torch-free module, not from the trainer's flag parser."""
    imports = {p.name: _imported_modules(p) for p in (PROJECT_DIR / "stack_config").glob("*.py")}
    readers = {name for name, found in imports.items() if any("training.loop" in m for m in found)}
    assert readers == {"train_args.py"}
    assert {m for m in imports["train_args.py"] if "training.loop" in m} == {
        "training.loop.settings"
    }


def test_the_flags_check_the_shared_choices() -> None:
    assert flags.PRECISIONS is settings.PRECISIONS
    assert flags.PARALLELISMS is settings.PARALLELISMS
