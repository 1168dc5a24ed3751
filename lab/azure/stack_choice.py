"""Which stack the lab's Azure tools read: ``--stack``, else the one Pulumi has selected."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from stack_config.files import PROJECT_DIR, StackSettings, load_stack, stack_names
from stack_config.model import ConfigError


def selected_stack(project_dir: Path = PROJECT_DIR) -> str | None:
    """The stack ``pulumi stack select`` chose for this project, if the CLI can tell."""
    pulumi = shutil.which("pulumi")
    if pulumi is None:
        return None
    try:
        done = subprocess.run(
            [pulumi, "stack", "--show-name", "--non-interactive"],
            cwd=project_dir,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = done.stdout.strip()
    return name if done.returncode == 0 and name else None


def resolve_stack(name: str | None, project_dir: Path = PROJECT_DIR) -> StackSettings:
    """The named (or selected) stack's settings; ``ConfigError`` names the way out."""
    stack = name or selected_stack(project_dir)
    if not stack:
        known = ", ".join(stack_names(project_dir)) or "none"
        raise ConfigError(
            [
                f"no stack selected: pass --stack NAME (stacks here: {known}) "
                "or run `pulumi stack select NAME`"
            ]
        )
    return load_stack(stack, project_dir)
