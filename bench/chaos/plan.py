"""What every schedule of a chaos campaign runs: the job, its training and its clocks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lab.local.scenario import Scenario, TrainSettings
from training.elastic.launch import STOP_MARGIN_S

MAX_NODES = 6
"""Two cores run every node's agent and worker: more would measure the machine, not the job."""
MAX_NPROC = 2
"""Training processes per node: 2 already runs 6 workers on two cores."""


@dataclass(frozen=True)
class ChaosPlan:
    """One campaign's settings; each schedule adds only its faults."""

    nodes: int = 3
    """Nodes at the start, and the job's most (maxReplicas)."""
    min_nodes: int = 1
    faults: tuple[int, int] = (3, 6)
    """Faults per schedule, drawn in this range."""
    nproc_per_node: tuple[int, ...] = (1, 2)
    """Training processes per node, one of these drawn for each schedule (a VM with that many
    GPUs); the global batch stays the same, so the trajectory does too."""
    max_steps: int = 240
    checkpoint_every_steps: int = 10
    min_step_time_s: float = 0.1
    """Pacing, so the schedule plays out before training ends on a fast machine."""
    stop_deadline_s: float = 10.0
    """The eviction save's deadline (shorter than the cluster's 25 s: schedules stay short)."""
    timeout_s: float = 480.0
    """A schedule that has not finished by then ends as ``timeout`` (a violation)."""
    partitions: bool = True
    """Schedules may draw a partition (its nodes then run in network namespaces: root)."""

    @property
    def grace_s(self) -> float:
        """An evicted node's SIGKILL comes this long after its SIGTERM: the pod's termination
        grace, the deadline's margin more (as the job sets them: training/launch.py)."""
        return self.stop_deadline_s + STOP_MARGIN_S

    def validate(self) -> None:
        """Raise ValueError naming the flag and the allowed values."""
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be 1-{MAX_NODES}, got {self.nodes}")
        if not 1 <= self.min_nodes <= self.nodes:
            raise ValueError(f"min nodes must be 1-{self.nodes}, got {self.min_nodes}")
        if not self.nproc_per_node or any(not 1 <= n <= MAX_NPROC for n in self.nproc_per_node):
            raise ValueError(
                f"--nproc-per-node must be a comma-separated list of 1-{MAX_NPROC}, "
                f"got {self.nproc_per_node}"
            )
        low, high = self.faults
        if not 1 <= low <= high:
            raise ValueError(f"--faults must be MIN-MAX with 1 <= MIN <= MAX, got {low}-{high}")
        if self.max_steps < 20:
            raise ValueError(f"--max-steps must be >= 20, got {self.max_steps}")

    def train(self) -> TrainSettings:
        """A tiny model in float64 (a lost or repeated step shows in the parameters), a dataset
        of 20 steps an epoch (every schedule crosses epochs)."""
        return TrainSettings(
            max_steps=self.max_steps,
            global_batch_size=24,
            micro_batch_size=8,
            model_width=4,
            model_blocks=1,
            checkpoint_every_steps=self.checkpoint_every_steps,
            log_every=1,
            min_step_time_s=self.min_step_time_s,
            train_records=480,
            test_records=48,
            dtype="float64",
            stop_deadline_s=self.stop_deadline_s,
        )

    def scenario(self, name: str, nproc_per_node: int = 1) -> Scenario:
        """The lab scenario of one schedule, without faults: the campaign's runner brings them."""
        return Scenario(
            name=name,
            nodes=self.nodes,
            nproc_per_node=nproc_per_node,
            min_nodes=self.min_nodes,
            max_nodes=self.nodes,
            timeout_s=self.timeout_s,
            train=self.train(),
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "grace_s": self.grace_s}
