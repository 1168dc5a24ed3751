"""Where a stack keeps its data, checkpoints and run records: its outputs, as the Pulumi CLI
prints them (``pulumi stack output --json``), read for ``lab data upload``, ``lab export`` and
``lab report --stack``, and how those commands end. The storage outputs are not secrets, so no
``--show-secrets``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lab.azure.stack_choice import selected_stack
from stack_config.files import PROJECT_DIR
from training.elastic.exit_codes import BAD_INPUT, OK, PERMANENT


class StackOutputsError(Exception):
    """The stack's outputs cannot be read, or lack what the command needs; one line."""


def stack_outputs(stack: str | None, project_dir: Path = PROJECT_DIR) -> tuple[str, dict[str, Any]]:
    """(the stack's name, its outputs): ``stack``, else the one ``pulumi stack select`` chose."""
    name = stack or selected_stack(project_dir)
    if not name:
        raise StackOutputsError("no stack selected: pass --stack NAME or run `pulumi stack select`")
    pulumi = shutil.which("pulumi")
    if pulumi is None:
        raise StackOutputsError("the pulumi CLI is not on PATH: it reads the stack's outputs")
    command = [pulumi, "stack", "output", "--json", "--stack", name, "--non-interactive"]
    try:
        done = subprocess.run(command, cwd=project_dir, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StackOutputsError(f"`pulumi stack output --stack {name}` failed: {exc}") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise StackOutputsError(f"`pulumi stack output --stack {name}` failed: {why}")
    try:
        outputs = json.loads(done.stdout or "{}")
    except ValueError:
        raise StackOutputsError(f"`pulumi stack output --stack {name}` printed no JSON") from None
    if not isinstance(outputs, dict) or not outputs:
        raise StackOutputsError(f"stack {name} has no outputs: run `pulumi up` first")
    return name, outputs


def _needed(outputs: Mapping[str, Any], stack: str, *keys: str) -> list[str]:
    missing = [k for k in keys if not isinstance(outputs.get(k), str) or not outputs[k]]
    if missing:
        raise StackOutputsError(
            f"stack {stack}'s outputs lack {', '.join(missing)}: is the stack up (`pulumi up`)?"
        )
    return [str(outputs[k]) for k in keys]


def data_uri(outputs: Mapping[str, Any], stack: str) -> str:
    """Where the workers copy the dataset from: the ``data`` container, with the stack's
    ``dataPrefix`` inside (``dataUri``, ``__main__.py``)."""
    (uri,) = _needed(outputs, stack, "dataUri")
    return uri


def checkpoint_uri(outputs: Mapping[str, Any], stack: str) -> str:
    """Where the job's checkpoints are (``checkpointUri``: its run identity's folder)."""
    (uri,) = _needed(outputs, stack, "checkpointUri")
    return uri


def stack_uri(
    given: str | None, stack: str | None, where: Callable[[Mapping[str, Any], str], str]
) -> str:
    """``given`` when the user named a location, else ``where`` in the stack's outputs."""
    if given:
        return given
    name, outputs = stack_outputs(stack)
    return where(outputs, name)


def storage_exit(action: Callable[[], None], bad_input: tuple[type[Exception], ...] = ()) -> int:
    """Run ``action`` and say how it ended: 0; 2 for bad input (no stack outputs, a wrong
    location, ``bad_input``); 1 when Azure or the store failed. One line on stderr."""
    from lab.azure.clients import AzureError  # the Azure SDKs: on use only

    try:
        action()
    except (StackOutputsError, ValueError, *bad_input) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except (AzureError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return PERMANENT
    return OK
