"""A lab scenario: a pure plan of nodes, training settings and faults.

The runner (``lab/local/runner.py``) turns a ``Scenario`` into processes. Faults run in the
order given; each waits for its trigger (``at_step`` or ``at_time``) and for the job to
have settled after the previous fault. Nodes are numbered 0..nodes-1 at start; every
``join`` and every node started after ``kill-all`` gets the next unused number, because a
node that takes part again under an old identity would not exercise the scale-up path.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, fields

from training.elastic.launch import LAUNCHERS, RendezvousSettings
from training.loop.config import ConfigError, parse_config

FAULT_KINDS = ("kill", "evict", "freeze", "join", "etcd-restart", "kill-all")
NODE_FAULTS = ("kill", "evict", "freeze")
RESTART_POLICIES = ("OnFailure", "Never")
# The synthetic dataset's data_batch_N.bin files; each must hold at least one record.
SYNTHETIC_TRAIN_FILES = 5


class ScenarioError(ValueError):
    """A scenario is invalid; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    kind: str
    """One of FAULT_KINDS."""
    node: int | None = None
    """Target node number, for kill, evict and freeze."""
    at_step: int | None = None
    """Inject once training reached this step (exclusive with at_time)."""
    at_time: float | None = None
    """Inject this many seconds after the nodes started (exclusive with at_step)."""
    grace_s: float = 15.0
    """evict: SIGKILL the node this long after SIGTERM (Azure's Spot notice is >= 30 s)."""
    down_s: float = 2.0
    """etcd-restart: seconds etcd stays down."""
    wipe_data: bool = False
    """etcd-restart: come back with an empty data dir (an etcd pod without a volume)."""
    nodes: int = 0
    """kill-all: how many new nodes start after every node was killed."""

    def describe(self) -> str:
        """Short human text, e.g. ``kill node-1 @ step 40``."""
        what = {
            "join": "join a new node",
            "kill-all": f"kill-all, start {self.nodes} new",
            "etcd-restart": f"etcd-restart ({self.down_s:g} s down)",
        }.get(self.kind, f"{self.kind} node-{self.node}")
        trigger = f"step {self.at_step}" if self.at_step is not None else f"t={self.at_time:g}s"
        return f"{what} @ {trigger}"


@dataclass(frozen=True)
class TrainSettings:
    """The training program's flags that a scenario sets (see ``training/loop/config.py``)."""

    task: str = "cifar"
    """What the nodes train (training/tasks/): cifar on a synthetic CIFAR-10, or charlm on the
    Tiny Shakespeare excerpt in training/data/samples/."""
    task_options: str = ""
    """The task's own flags, e.g. ``"--n-layer=2 --n-embd=64"`` for charlm; cifar's model size
    is ``model_width`` and ``model_blocks``."""
    eval_every: int = 0
    """Steps between the task's evaluations (0: none); the report shows the validation loss."""
    max_steps: int = 300
    global_batch_size: int = 32
    micro_batch_size: int = 16
    model_width: int = 8
    model_blocks: int = 1
    lr: float = 0.05
    seed: int = 0
    checkpoint_every_steps: int = 50
    checkpoint_every_seconds: int = 0
    checkpoint_keep: int = 3
    log_every: int = 1
    """1 in the lab: the report measures recovery to the first metrics line."""
    collective_timeout_s: int = 30
    """How long a collective may wait for a stalled peer: the cluster's 30 s. A frozen node is
    found sooner by the rendezvous (its key expires, its probe goes unanswered)."""
    emergency_saves: bool = True
    """Save the last completed step on SIGTERM or a peer's loss (off: periodic saves only)."""
    min_step_time_s: float = 0.0
    """Pacing: a tiny model on a fast machine would otherwise run through the fault schedule
    while a new node boots or etcd restarts."""
    train_records: int = 2048
    """Synthetic dataset size (records)."""
    test_records: int = 256
    dtype: str = "float32"
    """float64 makes a resume's exactness measurable (reduction order moves it by ~1e-15)."""
    stop_deadline_s: float = 25.0
    """The eviction save's deadline from SIGTERM: keep it inside an evict fault's grace_s."""

    def args(self, data_dir: str) -> list[str]:
        """The training program's command-line flags."""
        model = [f"--model-width={self.model_width}", f"--model-blocks={self.model_blocks}"]
        return [
            f"--task={self.task}",
            f"--data-dir={data_dir}",
            f"--max-steps={self.max_steps}",
            f"--global-batch-size={self.global_batch_size}",
            f"--micro-batch-size={self.micro_batch_size}",
            *(model if self.task == "cifar" else []),
            *shlex.split(self.task_options),
            f"--eval-every={self.eval_every}",
            f"--lr={self.lr}",
            f"--seed={self.seed}",
            f"--checkpoint-every-steps={self.checkpoint_every_steps}",
            f"--checkpoint-every-seconds={self.checkpoint_every_seconds}",
            f"--checkpoint-keep={self.checkpoint_keep}",
            f"--log-every={self.log_every}",
            f"--collective-timeout-s={self.collective_timeout_s}",
            f"--emergency-saves={'true' if self.emergency_saves else 'false'}",
            f"--min-step-time-s={self.min_step_time_s:g}",
            f"--dtype={self.dtype}",
            f"--stop-deadline-s={self.stop_deadline_s:g}",
        ]


@dataclass(frozen=True)
class Scenario:
    """Nodes, the elastic policy, training settings and the faults to inject."""

    name: str
    nodes: int = 3
    """Nodes started at the beginning, numbered 0..nodes-1."""
    min_nodes: int = 1
    max_nodes: int = 3
    nproc_per_node: int = 1
    """Training processes per node, as on a VM size with that many GPUs (nprocPerNode)."""
    max_restarts: int = 100
    """Per agent; every lost peer costs each survivor one."""
    restart_policy: str = "OnFailure"
    """What happens to a node whose agent exits non-zero on its own: the pod's restartPolicy."""
    restart_delay_s: float = 1.0
    """The kubelet's delay before it restarts a failed container."""
    timeout_s: float = 600.0
    """Give up (and fail the run) after this long."""
    settle_timeout_s: float | None = None
    """Give up (status ``timeout``) when the job has not settled this long after a fault."""
    stop_when_settled: bool = False
    """End the run (status ``settled``) once the last fault settled, not at max_steps."""
    launcher: str = "warm"
    """How agents start workers: ``warm`` (forked, torch already imported) or ``torchrun``."""
    train: TrainSettings = field(default_factory=TrainSettings)
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    faults: tuple[Fault, ...] = ()


@dataclass(frozen=True)
class MembershipChange:
    """What a fault does to the set of nodes, planned ahead."""

    stopped: tuple[int, ...]
    started: tuple[int, ...]
    world_size: int
    """Ranks once the job settled after the fault: live nodes x processes per node."""


def plan_membership(scenario: Scenario) -> list[MembershipChange]:
    """One MembershipChange per fault; raise ScenarioError naming the fault that is invalid."""
    live = set(range(scenario.nodes))
    next_id = scenario.nodes
    changes: list[MembershipChange] = []
    for index, fault in enumerate(scenario.faults):
        where = f"faults[{index}]"
        stopped: tuple[int, ...] = ()
        started: tuple[int, ...] = ()
        if fault.kind in NODE_FAULTS:
            if fault.node not in live:
                alive = ", ".join(str(n) for n in sorted(live)) or "none"
                raise ScenarioError(
                    f"{where}.node: cannot {fault.kind} node {fault.node}, it is not running "
                    "at that point; "
                    f"running nodes: {alive}"
                )
            stopped = (fault.node,)
        elif fault.kind == "join":
            if len(live) >= scenario.max_nodes:
                raise ScenarioError(
                    f"{where}: cannot join, {len(live)} nodes already run and max_nodes is "
                    f"{scenario.max_nodes}"
                )
            started = (next_id,)
        elif fault.kind == "kill-all":
            stopped = tuple(sorted(live))
            started = tuple(range(next_id, next_id + fault.nodes))
        live = (live - set(stopped)) | set(started)
        next_id += len(started)
        if len(live) > scenario.max_nodes:
            raise ScenarioError(
                f"{where}.nodes: {fault.kind} starts {len(started)} new node(s), more than "
                f"max_nodes {scenario.max_nodes}; allowed: 1..{scenario.max_nodes}"
            )
        if len(live) < scenario.min_nodes:
            raise ScenarioError(
                f"{where}: {fault.kind} leaves {len(live)} node(s), "
                f"below min_nodes {scenario.min_nodes}"
            )
        changes.append(MembershipChange(stopped, started, len(live) * scenario.nproc_per_node))
    return changes


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ScenarioError(message)


def _validate_trigger(where: str, fault: Fault, max_steps: int, timeout_s: float) -> None:
    _require(
        (fault.at_step is None) != (fault.at_time is None),
        f"{where}: set exactly one of at_step and at_time",
    )
    if fault.at_step is not None:
        _require(
            1 <= fault.at_step < max_steps,
            f"{where}.at_step: {fault.at_step} is out of range; allowed: 1..{max_steps - 1} "
            f"(train.max_steps is {max_steps})",
        )
    if fault.at_time is not None:
        # A trigger past the run's timeout would only ever end in a timeout.
        _require(
            0 <= fault.at_time < timeout_s,
            f"{where}.at_time: {fault.at_time:g} is out of range; allowed: 0 <= at_time < "
            f"timeout_s ({timeout_s:g})",
        )


def _validate_fault(index: int, fault: Fault, max_steps: int, timeout_s: float) -> None:
    where = f"faults[{index}]"
    _require(
        fault.kind in FAULT_KINDS,
        f"{where}.kind: unknown fault kind {fault.kind!r}; allowed: {', '.join(FAULT_KINDS)}",
    )
    _validate_trigger(where, fault, max_steps, timeout_s)
    _require(
        (fault.node is not None) == (fault.kind in NODE_FAULTS),
        f"{where}.node: required for {', '.join(NODE_FAULTS)} and not allowed for {fault.kind}",
    )
    _require(fault.grace_s >= 0, f"{where}.grace_s: must be >= 0, got {fault.grace_s}")
    _require(fault.down_s >= 0, f"{where}.down_s: must be >= 0, got {fault.down_s}")
    if fault.kind == "kill-all":
        _require(fault.nodes >= 1, f"{where}.nodes: kill-all must start >= 1 new node")
    else:
        _require(fault.nodes == 0, f"{where}.nodes: only allowed for kill-all, not {fault.kind}")


def _train_error(err: ConfigError) -> ScenarioError:
    """The training program's message, with its flag turned back into the scenario key."""
    flag, _, rest = str(err).partition(" ")
    name = flag.removeprefix("--").replace("-", "_")
    if flag.startswith("--") and name in {f.name for f in fields(TrainSettings)}:
        return ScenarioError(f"train.{name}: {rest}")
    return ScenarioError(f"train: {err}")


def _validate_train(train: TrainSettings) -> None:
    """The training program's own checks, up front: a value it rejects would otherwise fail
    every worker at start, and the lab would only notice when the run times out."""
    try:
        parse_config([*train.args("<data-dir>"), "--checkpoint-uri=<checkpoints>"], env={})
    except ConfigError as err:
        raise _train_error(err) from None
    except SystemExit:  # argparse: a flag the task does not have, its message on stderr
        raise ScenarioError(
            f"train.task_options: {train.task_options!r} holds a flag the {train.task} task "
            f"does not have (python -m training.train --task={train.task} --help lists them)"
        ) from None
    if train.task != "cifar":
        return
    least = max(train.global_batch_size, SYNTHETIC_TRAIN_FILES)
    _require(
        train.train_records >= least,
        f"train.train_records: {train.train_records} is too small; allowed: >= {least} "
        f"(one global batch, train.global_batch_size, and one record in each of the "
        f"{SYNTHETIC_TRAIN_FILES} data_batch files)",
    )
    _require(
        train.test_records >= 1,
        f"train.test_records: must be >= 1, got {train.test_records}",
    )


def validate_scenario(scenario: Scenario) -> list[MembershipChange]:
    """Check every rule; return the membership plan. Raises ScenarioError."""
    _require(scenario.min_nodes >= 1, f"min_nodes: must be >= 1, got {scenario.min_nodes}")
    _require(
        scenario.nproc_per_node >= 1,
        f"nproc_per_node: must be >= 1, got {scenario.nproc_per_node}",
    )
    _require(
        scenario.min_nodes <= scenario.nodes <= scenario.max_nodes,
        f"nodes: {scenario.nodes} must be within min_nodes..max_nodes "
        f"({scenario.min_nodes}..{scenario.max_nodes})",
    )
    _require(
        scenario.restart_policy in RESTART_POLICIES,
        f"restart_policy: {scenario.restart_policy!r}; allowed: {', '.join(RESTART_POLICIES)}",
    )
    _require(
        scenario.launcher in LAUNCHERS,
        f"launcher: {scenario.launcher!r}; allowed: {', '.join(LAUNCHERS)}",
    )
    _require(scenario.timeout_s > 0, f"timeout_s: must be > 0, got {scenario.timeout_s}")
    _require(
        scenario.restart_delay_s >= 0,
        f"restart_delay_s: must be >= 0, got {scenario.restart_delay_s}",
    )
    _require(
        scenario.settle_timeout_s is None or scenario.settle_timeout_s > 0,
        f"settle_timeout_s: must be > 0 (or unset), got {scenario.settle_timeout_s}",
    )
    _require(scenario.max_restarts >= 0, f"max_restarts: must be >= 0, got {scenario.max_restarts}")
    _validate_train(scenario.train)
    try:
        scenario.rendezvous.validate()
    except ValueError as err:  # "rendezvous <key> must be ...": name the scenario key
        key, _, rest = str(err).removeprefix("rendezvous ").partition(" ")
        raise ScenarioError(f"rendezvous.{key}: {rest}") from None
    steps = [f.at_step for f in scenario.faults if f.at_step is not None]
    _require(
        steps == sorted(steps), "faults: at_step values must not decrease (faults run in order)"
    )
    for index, fault in enumerate(scenario.faults):
        _validate_fault(index, fault, scenario.train.max_steps, scenario.timeout_s)
    return plan_membership(scenario)
