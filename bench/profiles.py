"""The two contestants: plain ``torchrun`` with a periodic checkpoint, and the lab.

Both run the same training program, the same model and the same periodic checkpoint
cadence on the same etcd rendezvous; only what this module names differs. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from stack_config.model import JobConfig
from training.elastic.launch import RendezvousSettings

BASELINE = "baseline"
LAB = "lab"
PROFILE_NAMES = (BASELINE, LAB)

# torchrun's own defaults (DynamicRendezvousHandler): last call 30 s, a heartbeat every 5 s,
# a node dead after 3 missed ones; join timeout 600 s.
TORCHRUN_DEFAULT_RENDEZVOUS = RendezvousSettings(
    last_call_timeout_s=30, keep_alive_interval_s=5, keep_alive_max_attempt=3, join_timeout_s=600
)
# gloo's default process-group timeout (NCCL's is 10 min).
GLOO_DEFAULT_TIMEOUT_S = 1800
# The cluster's collective timeout (the stack's collectiveTimeoutSeconds default): the lab
# runs what the PyTorchJob runs, so a freeze is not detected by a short lab-only timeout.
LAB_COLLECTIVE_TIMEOUT_S = JobConfig.collective_timeout_s


@dataclass(frozen=True)
class Profile:
    """What one contestant configures."""

    name: str
    rendezvous: RendezvousSettings
    emergency_saves: bool
    """Save the last completed step on SIGTERM or a peer's loss."""
    collective_timeout_s: int
    """Process-group timeout: bounds a collective stalled by a frozen peer."""
    launcher: str
    """``torchrun`` (a new interpreter per worker) or ``warm`` (workers forked, torch loaded)."""
    description: str

    def as_dict(self) -> dict[str, object]:
        """The profile as JSON-ready values."""
        return {
            "name": self.name,
            "description": self.description,
            "rendezvous_conf": self.rendezvous.conf(),
            "emergency_saves": self.emergency_saves,
            "collective_timeout_s": self.collective_timeout_s,
            "launcher": self.launcher,
        }


def baseline_profile() -> Profile:
    """torchrun's defaults, periodic checkpoints only, gloo's default collective timeout."""
    return Profile(
        name=BASELINE,
        rendezvous=TORCHRUN_DEFAULT_RENDEZVOUS,
        emergency_saves=False,
        collective_timeout_s=GLOO_DEFAULT_TIMEOUT_S,
        launcher="torchrun",
        description="torchrun defaults + periodic checkpoint",
    )


def lab_profile() -> Profile:
    """The rendezvous of ``training/elastic/launch.py``, emergency saves, the cluster's collective
    timeout, warm workers."""
    return Profile(
        name=LAB,
        rendezvous=RendezvousSettings(),
        emergency_saves=True,
        collective_timeout_s=LAB_COLLECTIVE_TIMEOUT_S,
        launcher="warm",
        description="the lab: its rendezvous handler + emergency saves + the cluster's "
        "collective timeout + warm workers",
    )


def profile(name: str) -> Profile:
    """The profile called ``name``; ValueError naming the allowed names otherwise."""
    builders = {BASELINE: baseline_profile, LAB: lab_profile}
    if name not in builders:
        raise ValueError(f"profile {name!r} is unknown; allowed: {', '.join(PROFILE_NAMES)}")
    return builders[name]()
