"""How every training worker is launched: one source of truth for rendezvous and env.

The PyTorchJob (``workloads/job.py``) and the local lab (``lab/``) both build from this
module, so the cluster and the laptop run ``torchrun`` with the same rendezvous timeouts,
the same environment and the same entry point. Pure: no torch import, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# What the PyTorchJob names in elasticPolicy.rdzvBackend (its CRD allows c10d, etcd, etcd-v2).
# training-operator v1.9.4 only copies it into PET_RDZV_BACKEND (pkg/controller.v1/pytorch/
# elastic.go, generateEnvBackend) beside PET_RDZV_ENDPOINT, so the value only has to say what
# the endpoint is: "etcd" (etcd-v2 names the API etcd 3.6 removed; c10d an agent's TCPStore).
# The agent serves it with its own handler on etcd's v3 API (training/elastic/rendezvous.py).
RDZV_BACKEND = "etcd"
ETCD_BACKENDS = (RDZV_BACKEND,)
# Where the agent writes the round its workers belong to, for them to log.
ROUND_FILE_ENV = "TRAIN_RDZV_ROUND_FILE"
RDZV_PORT = 2379
# The module torchrun runs in every worker (``torchrun --module training.train``).
TRAIN_MODULE = "training.train"
# The container's entry: checks the rendezvous endpoint, then runs torchrun's agent.
AGENT_MODULE = "training.agent"
# How the agent starts workers (env TRAIN_LAUNCHER): "warm" forks them from a fork server that
# has torch imported (training/launcher.py); "torchrun" execs plain torchrun, which starts a
# new interpreter per worker and so pays for the imports again on every restart.
LAUNCHER_ENV = "TRAIN_LAUNCHER"
LAUNCHERS = ("warm", "torchrun")
# In the cluster the agent copies the dataset from this Blob URL into this directory before it
# joins (training/data/fetch_data.py); the training flags' --data-dir falls back to the directory.
DATA_URI_ENV = "TRAIN_DATA_URI"
DATA_DIR_ENV = "TRAIN_DATA_DIR"


EVICTION_NOTICE_S = 30
"""Azure deletes an evicted Spot VM at least this long after its notice: the kubelet must have
stopped the pod, and the emergency save be done, before then."""
STOP_MARGIN_S = 3
"""The workers' stop deadline (``--stop-deadline-s``) ends this long before the pod's
termination grace, when the kubelet sends SIGKILL: time for the processes to exit."""
DEFAULT_TERMINATION_GRACE_S = 28
"""The worker pods' ``terminationGracePeriodSeconds``: the deadline is 25 s of the 30 s notice."""


def stop_deadline_s(termination_grace_s: int) -> int:
    """The workers' ``--stop-deadline-s`` for a pod with this termination grace."""
    return termination_grace_s - STOP_MARGIN_S


def termination_grace_problem(termination_grace_s: int) -> str | None:
    """Why this grace cannot hold the eviction's save (as "must be A-B, ..."), or None."""
    low, high = STOP_MARGIN_S + 1, EVICTION_NOTICE_S - 1
    if low <= termination_grace_s <= high:
        return None
    return (
        f"must be {low}-{high}: inside Azure's {EVICTION_NOTICE_S} s eviction notice, and "
        f"{STOP_MARGIN_S} s more than the workers' stop deadline (at least 1 s), which is "
        f"derived from it; got {termination_grace_s}"
    )


MEASURED_HEARTBEATS_PER_S = 64
"""The most agents' heartbeats per second the rendezvous was measured with, with no live agent
taken for dead (``python -m bench rendezvous-scale``: 64 agents, a heartbeat a second, one
etcd). A job beyond it must beat less often: the stack config refuses it otherwise."""


@dataclass(frozen=True)
class RendezvousSettings:
    """Rendezvous clocks (training/elastic/rendezvous.py). torchrun's defaults take ~46 s to recover
    from a lost node; these, with our handler, about a second (docs/benchmarks.md)."""

    last_call_timeout_s: int = 1
    """The first round waits this long after min nodes joined, for nodes still starting.
    Later rounds wait for exactly the nodes they expect, with no last call."""
    keep_alive_interval_s: int = 1
    """Heartbeat period: each agent refreshes its own key (a TTL) this often."""
    keep_alive_max_attempt: int = 5
    """A node's key expires after interval x max_attempt seconds (its lease's TTL: 5 s, the
    least etcd's maintainers advise; docs/rendezvous.md, "The TTL") without a heartbeat, and
    only then may a node that does not answer its probe be taken for dead; a node that cannot
    renew for the TTL less a margin stops its own workers (the fence)."""
    join_timeout_s: int = 900
    """First round waits this long for min nodes: GPU Spot nodes autoscale from zero."""

    def heartbeats_per_s(self, max_nodes: int) -> float:
        """What ``max_nodes`` agents write to etcd between rounds."""
        return max_nodes / self.keep_alive_interval_s

    def validate(self) -> None:
        """Raise ValueError naming the setting when a timeout is not a positive integer."""
        for name in (
            "last_call_timeout_s",
            "keep_alive_interval_s",
            "keep_alive_max_attempt",
            "join_timeout_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"rendezvous {name} must be an integer >= 1, got {value!r}")

    def conf(self) -> dict[str, str]:
        """torchrun's ``--rdzv-conf`` keys (DynamicRendezvousHandler's parameters)."""
        return {
            "last_call_timeout": str(self.last_call_timeout_s),
            "keep_alive_interval": str(self.keep_alive_interval_s),
            "keep_alive_max_attempt": str(self.keep_alive_max_attempt),
            "join_timeout": str(self.join_timeout_s),
        }

    def conf_arg(self) -> str:
        """The conf as torchrun's ``key=value,key=value`` string."""
        return conf_arg(self.conf())


def conf_arg(conf: dict[str, str]) -> str:
    """A rendezvous conf as torchrun's ``--rdzv-conf`` (``PET_RDZV_CONF``) string."""
    return ",".join(f"{k}={v}" for k, v in conf.items())


ETCD_MEMBERS = "etcd_members"
"""The rendezvous conf key that lists each etcd member's ``host:port``, beside the endpoint."""
MEMBERS_SEPARATOR = ";"
"""Between ``etcd_members``' endpoints: torchrun's ``--rdzv-conf`` splits its pairs on commas."""


@dataclass(frozen=True)
class ElasticPolicy:
    """What the PyTorchJob's ``elasticPolicy`` says, and what the lab's agents get as PET_* env."""

    rdzv_host: str
    rdzv_id: str
    min_nodes: int
    max_nodes: int
    max_restarts: int
    rdzv_port: int = RDZV_PORT
    nproc_per_node: int = 1
    rendezvous: RendezvousSettings = RendezvousSettings()
    etcd_members: tuple[str, ...] = ()
    """Each etcd member's ``host:port``, beside the endpoint (training/elastic/etcd_v3.py,
    ``Members``)."""

    def rdzv_conf(self) -> dict[str, str]:
        """torchrun's ``--rdzv-conf``: the clocks, and the etcd members."""
        conf = self.rendezvous.conf()
        if self.etcd_members:
            conf[ETCD_MEMBERS] = MEMBERS_SEPARATOR.join(self.etcd_members)
        return conf

    def validate(self) -> None:
        """Raise ValueError naming the setting when a bound is out of range."""
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if not self.rdzv_id:
            raise ValueError("rdzv_id must not be empty: each run needs a fresh id")
        self.rendezvous.validate()

    def pet_env(self) -> dict[str, str]:
        """The env the training operator sets from elasticPolicy; torchrun reads PET_* as flags."""
        return {
            "PET_RDZV_BACKEND": RDZV_BACKEND,
            "PET_RDZV_ENDPOINT": f"{self.rdzv_host}:{self.rdzv_port}",
            "PET_RDZV_ID": self.rdzv_id,
            "PET_NNODES": f"{self.min_nodes}:{self.max_nodes}",
            "PET_MAX_RESTARTS": str(self.max_restarts),
            "PET_NPROC_PER_NODE": str(self.nproc_per_node),
            "PET_RDZV_CONF": conf_arg(self.rdzv_conf()),
        }


def worker_env(
    *, checkpoint_uri: str, local_dir: str, collective_timeout_s: int, launcher: str = "warm"
) -> dict[str, str]:
    """Env every worker container gets, in the cluster and in the lab."""
    if collective_timeout_s < 1:
        raise ValueError(f"collective_timeout_s must be >= 1, got {collective_timeout_s}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    return {
        LAUNCHER_ENV: launcher,
        # torch 2.13 hangs a *new* node on scale-up when the agent's TCP store is shared.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # NCCL, as torch 2.13 documents these ("ProcessGroupNCCL Environment Variables"). A
        # lost peer is caught by the step guard (training/loop/step_guard.py), not by NCCL:
        # 2 = on an error or timeout the watchdog only aborts the communicator, so stuck
        # kernels return and the process lives to save (the default, 3, tears it down).
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        # 0: blocking wait would take precedence over async error handling, and DDP never
        # calls the wait it makes blocking.
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        # The agent and the fork server ask "is there a GPU?" through NVML, which does not
        # initialise CUDA: a process that forks must not have.
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        "TRAIN_CHECKPOINT_URI": checkpoint_uri,
        "TRAIN_LOCAL_DIR": local_dir,
        # A frozen peer (no RST from a deleted VM) ends the collective after this, not 30 min.
        "TRAIN_COLLECTIVE_TIMEOUT_S": str(collective_timeout_s),
        "PYTHONUNBUFFERED": "1",
    }


def train_command(train_args: list[str], python: str = "python") -> list[str]:
    """The container command: ``training.agent`` checks the rendezvous, then runs torchrun's
    agent, which takes its elastic flags from the PET_* env."""
    return [python, "-m", AGENT_MODULE, "--module", TRAIN_MODULE, *train_args]
