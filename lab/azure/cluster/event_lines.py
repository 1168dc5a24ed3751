"""Kubernetes events as the status line of ``lab watch`` and ``lab drill`` shows them: the ones
that tell what the cluster does to the job, each in one line."""

from __future__ import annotations

from lab.report.run_logs import ClusterEvent

SHOWN_REASONS = (
    "Scheduled", "Pulled", "Started", "Killing", "Preempting", "Evicted", "TriggeredScaleUp",
    "ScaleDown", "RegisteredNode", "RemovingNode", "NodeNotReady", "FailedScheduling",
)  # fmt: skip


def event_line(event: ClusterEvent) -> str | None:
    """The status line's words for an event the user should see; None for the others."""
    if event.reason not in SHOWN_REASONS:
        return None
    return f"{event.reason} {event.kind.lower()} {event.name}"
