"""The lab scenarios the benchmarks run: one fault after warm-up, and a fault-free run.

Pure: a ``RecoveryPlan`` and a ``Profile`` in, a validated lab ``Scenario`` out.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.profiles import Profile
from lab.local.scenario import Fault, Scenario, TrainSettings, validate_scenario

FAULT_KINDS = ("kill", "evict", "freeze", "join", "etcd")
"""Hard loss (SIGKILL), graceful eviction (SIGTERM), silent loss (SIGSTOP), a new node, and
etcd down for a while with the membership unchanged."""
# The node that is lost: it runs global rank 0 and hosts the workers' store, the worst case.
FAULTED_NODE = 0


@dataclass(frozen=True)
class RecoveryPlan:
    """The training run each recovery session makes: a tiny model, a few hundred steps."""

    nodes: int = 3
    """Nodes before a loss and after a join (also max_nodes, so a join fills the job)."""
    fault_at_step: int = 30
    """Warm-up: the fault comes once training reached this step."""
    steps_after_fault: int = 5000
    """max_steps is this far past the fault step: training must outlast the recovery (a
    session ends once the fault settled, long before)."""
    checkpoint_every_steps: int = 20
    """The periodic durable checkpoint, the same for both profiles."""
    recovery_cap_s: float = 60.0
    """A fault that has not recovered this long after it is reported as no recovery."""
    eviction_grace_s: float = 15.0
    """evict: SIGKILL this long after SIGTERM (Azure's Spot notice is at least 30 s)."""
    etcd_down_s: float = 5.0
    """etcd: how long etcd stays down."""
    model_width: int = 8
    model_blocks: int = 1
    global_batch_size: int = 32
    micro_batch_size: int = 16

    def validate(self) -> None:
        """Raise ValueError naming the setting that is out of range."""
        if self.nodes < 2:
            raise ValueError(f"recovery nodes must be >= 2 (a survivor), got {self.nodes}")
        if self.fault_at_step <= self.checkpoint_every_steps:
            raise ValueError(
                f"fault_at_step ({self.fault_at_step}) must come after the first periodic "
                f"checkpoint (checkpoint_every_steps {self.checkpoint_every_steps})"
            )
        if self.steps_after_fault < 1:
            raise ValueError(f"steps_after_fault must be >= 1, got {self.steps_after_fault}")
        if self.recovery_cap_s <= 0:
            raise ValueError(f"recovery_cap_s must be > 0, got {self.recovery_cap_s}")

    def train(self, profile: Profile) -> TrainSettings:
        """The training flags of a recovery session under ``profile``."""
        return TrainSettings(
            max_steps=self.fault_at_step + self.steps_after_fault,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            model_width=self.model_width,
            model_blocks=self.model_blocks,
            checkpoint_every_steps=self.checkpoint_every_steps,
            log_every=1,  # downtime ends at the first metrics line: log every step
            collective_timeout_s=profile.collective_timeout_s,
            emergency_saves=profile.emergency_saves,
        )


def _fault(kind: str, plan: RecoveryPlan) -> Fault:
    if kind == "join":
        return Fault("join", at_step=plan.fault_at_step)
    if kind == "etcd":
        return Fault("etcd-restart", at_step=plan.fault_at_step, down_s=plan.etcd_down_s)
    return Fault(kind, node=FAULTED_NODE, at_step=plan.fault_at_step, grace_s=plan.eviction_grace_s)


def recovery_scenario(kind: str, profile: Profile, plan: RecoveryPlan) -> Scenario:
    """One session: ``plan.nodes`` nodes (one fewer for a join), one ``kind`` fault."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"fault kind {kind!r} is unknown; allowed: {', '.join(FAULT_KINDS)}")
    plan.validate()
    start_nodes = plan.nodes - 1 if kind == "join" else plan.nodes
    # The first round of a job below max_nodes waits out the last call before it trains.
    startup_s = profile.rendezvous.last_call_timeout_s + 60.0
    scenario = Scenario(
        name=f"bench-{kind}-{profile.name}",
        nodes=start_nodes,
        min_nodes=1,
        max_nodes=plan.nodes,
        timeout_s=startup_s + plan.recovery_cap_s + 120.0,
        settle_timeout_s=plan.recovery_cap_s,
        stop_when_settled=True,
        launcher=profile.launcher,
        train=plan.train(profile),
        rendezvous=profile.rendezvous,
        faults=(_fault(kind, plan),),
    )
    validate_scenario(scenario)
    return scenario


@dataclass(frozen=True)
class SteadyPlan:
    """The fault-free runs that compare step times: the lab's default model, two nodes."""

    nodes: int = 2
    max_steps: int = 40
    warmup_steps: int = 10
    """Steps dropped from each run before taking the median step time."""
    checkpoint_every_steps: int = 20
    """The elastic run's periodic durable checkpoint (the static run has none)."""
    model_width: int = 16
    model_blocks: int = 2
    global_batch_size: int = 256
    micro_batch_size: int = 64

    def validate(self) -> None:
        """Raise ValueError naming the setting that is out of range."""
        if self.nodes < 2:
            raise ValueError(f"steady-state nodes must be >= 2, got {self.nodes}")
        if not 0 <= self.warmup_steps < self.max_steps - 1:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must leave at least 2 of max_steps "
                f"({self.max_steps}) to measure"
            )


def steady_train(plan: SteadyPlan, profile: Profile, *, checkpoints: bool) -> TrainSettings:
    """Training flags of a steady-state run; ``checkpoints`` off means no periodic durable
    saves and no emergency saves (the static run: plain torchrun)."""
    return TrainSettings(
        max_steps=plan.max_steps,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.micro_batch_size,
        model_width=plan.model_width,
        model_blocks=plan.model_blocks,
        checkpoint_every_steps=plan.checkpoint_every_steps if checkpoints else 0,
        log_every=1,
        collective_timeout_s=profile.collective_timeout_s,
        emergency_saves=profile.emergency_saves and checkpoints,
    )


def steady_scenario(plan: SteadyPlan, profile: Profile) -> Scenario:
    """The lab's elastic run without faults: etcd, ``plan.nodes`` nodes, checkpoints on."""
    plan.validate()
    scenario = Scenario(
        name=f"bench-steady-{profile.name}",
        nodes=plan.nodes,
        # Its first round waits for every node: with fewer allowed, a loaded machine let one
        # node train every step alone before the other's agent was up (nothing measured).
        min_nodes=plan.nodes,
        max_nodes=plan.nodes,
        timeout_s=600.0,
        launcher=profile.launcher,
        train=steady_train(plan, profile, checkpoints=True),
        rendezvous=profile.rendezvous,
    )
    validate_scenario(scenario)
    return scenario
