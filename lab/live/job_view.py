"""The runner's live picture of the job, built from the records as they arrive."""

from __future__ import annotations

from dataclasses import dataclass

from training.records import (
    CHECKPOINT_SAVED,
    DATA_COPIED,
    DATA_WAITING,
    EMERGENCY_SAVE,
    FINISHED,
    METRICS,
    PEER_FAILURE,
    RESUMED,
    STARTED,
    Record,
)


def describe_event(record: Record) -> str:
    """A short text for the status line, e.g. ``resumed step 120 (local) on node-1``."""
    name = record.get("event", "?")
    details = {
        RESUMED: f"step {record.get('step')} ({record.get('source')}), "
        f"world {record.get('world_size')}",
        CHECKPOINT_SAVED: f"step {record.get('step')}",
        EMERGENCY_SAVE: f"step {record.get('step')} ({record.get('reason')})",
        PEER_FAILURE: f"step {record.get('step')}",
        FINISHED: f"step {record.get('step')}",
        STARTED: f"rank {record.get('rank')}",
        # The agent's, before it joins: the data source has no completion marker yet.
        DATA_WAITING: f"{record.get('waited_s')} s: {record.get('why')}; {record.get('hint')}",
        DATA_COPIED: f"{record.get('files')} files, {record.get('copied')} copied now",
    }.get(name, "")
    return f"{name} {details} on {record.get('node')}".replace("  ", " ")


@dataclass
class JobView:
    """Latest step, world size and loss; counts metrics lines since the last restart.

    A fault has *settled* once ``settle_lines`` metrics lines arrived at the planned world
    size after both the injection and the last ``resumed`` event.
    """

    step: int = 0
    world_size: int = 0
    loss: float | None = None
    last_event: str = "-"
    finished: bool = False
    lines_since_reset: int = 0
    reset_at: float = 0.0
    metrics_ts: float = 0.0
    resumed_ts: float = 0.0
    """When the latest ``resumed`` event was logged: a round that started training."""

    def observe(self, record: Record) -> None:
        """Fold one record into the view."""
        if record["kind"] == METRICS:
            if record["ts"] < self.metrics_ts:
                return  # a late line from an older round, read after a newer one
            self.metrics_ts = float(record["ts"])
            self.step = int(record["step"])
            self.world_size = int(record["world_size"])
            self.loss = float(record["loss"])
            if record["ts"] >= self.reset_at:
                self.lines_since_reset += 1
            return
        name = record.get("event")
        if name == RESUMED:
            self.step = int(record["step"])
            self.resumed_ts = max(self.resumed_ts, float(record["ts"]))
            self.reset(float(record["ts"]))
        if name == FINISHED:
            self.finished = True
        if name != STARTED:  # every worker start would drown the interesting events
            self.last_event = describe_event(record)

    def reset(self, ts: float) -> None:
        """Start counting metrics lines again from ``ts``."""
        self.reset_at = max(self.reset_at, ts)
        self.lines_since_reset = 0

    def settled(self, world_size: int, settle_lines: int) -> bool:
        """Training runs at ``world_size`` and has logged ``settle_lines`` lines since a reset."""
        return self.world_size == world_size and self.lines_since_reset >= settle_lines
