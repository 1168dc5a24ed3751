"""What a worker pod runs: the lab's training loop with the stack's flags, or a plain torchrun
script of the user's package, and the folder of the dataset it reads.

Either way the container's entry is the agent (``training/agent.py``): it checks the
rendezvous, copies the data to the pod's disk, then starts the workers warm or, with
``TRAIN_LAUNCHER=torchrun``, execs plain torchrun with the same arguments. A script therefore
gets the same rendezvous, image and data as the loop (docs/your-model-on-azure.md says what it
does not get). Pure: no pulumi import.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.elastic.launch import AGENT_MODULE, train_command


@dataclass(frozen=True)
class WorkerProgram:
    """The stack's ``launcher``, ``script``, ``trainArgs`` and ``dataPrefix``, resolved."""

    launcher: str = "warm"
    """``TRAIN_LAUNCHER``: warm workers, or plain torchrun."""
    script: str = ""
    """A plain torchrun script in the image's /app instead of the lab's loop ("": the loop)."""
    flags: tuple[str, ...] = ()
    """``trainArgs`` as flags (``--lr=0.0004``): after the loop's own, or the script's."""
    data_prefix: str = ""
    """The folder of the data container the agent copies ("": all of it)."""


def worker_command(program: WorkerProgram, loop_args: list[str]) -> list[str]:
    """The container's command: the agent with the loop's flags, then the stack's; or with the
    script and the stack's flags as its arguments."""
    if program.script:
        return ["python", "-m", AGENT_MODULE, program.script, *program.flags]
    return train_command([*loop_args, *program.flags])


def data_uri(program: WorkerProgram, mount: str) -> str:
    """``TRAIN_DATA_URI``: the dataset's mount, or the folder of it ``dataPrefix`` names."""
    prefix = program.data_prefix.strip("/")
    return f"{mount}/{prefix}" if prefix else mount
