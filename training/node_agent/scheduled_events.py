"""Azure Scheduled Events: the document the instance metadata service serves, and what it says.

The API (Azure, "Azure Metadata Service: Scheduled Events for Linux VMs"): ``GET
http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01`` with the header
``Metadata: true`` (without it, "Bad Request"); the answer is ``{"DocumentIncarnation": int,
"Events": [{"EventId", "EventType": "Reboot" | "Redeploy" | "Freeze" | "Preempt" | "Terminate",
"ResourceType": "VirtualMachine", "Resources": [vm names], "EventStatus": "Scheduled" |
"Started", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT" (blank once started), "Description",
"EventSource", "DurationInSeconds"}]}``, an empty ``Events`` when nothing is scheduled. A Spot
VM's eviction is ``Preempt`` with at least 30 s of notice. Events of every VM of a scale set's
placement group are delivered to all of them, so "check the Resources field in the event to
identify which VMs are affected". The docs recommend polling once a second, and warn that the
first request enables the service and may take up to two minutes to answer. A ``POST`` of
``StartRequests`` would acknowledge an event and let Azure shorten the notice: this module has no
such call. Pure except ``fetch``.
"""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

METADATA_URL = "http://169.254.169.254"
API_VERSION = "2020-07-01"
PATH = "/metadata/scheduledevents"
PREEMPT = "Preempt"
FIRST_CALL_TIMEOUT_S = 130.0
"""The first request enables Scheduled Events and may take up to two minutes to answer."""
POLL_TIMEOUT_S = 2.0

# The cloud provider's providerID of a scale set VM and of a standalone VM; Scheduled Events
# names a scale set instance "<scale set>_<instance id>" (maksim-paskal/aks-node-termination-
# handler, pkg/types/types.go, NewAzureResource: `fmt.Sprintf("%s_%s", ...)`).
_SCALE_SET_VM = re.compile(
    r"^azure:///subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Compute/"
    r"virtualMachineScaleSets/(?P<scale_set>[^/]+)/virtualMachines/(?P<instance>[^/]+)$",
    re.IGNORECASE,
)
_VM = re.compile(
    r"^azure:///subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Compute/"
    r"virtualMachines/(?P<name>[^/]+)$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class ScheduledEvent:
    """One event of the document."""

    event_id: str
    event_type: str
    resources: tuple[str, ...]
    """The VMs it affects, by the names Scheduled Events uses (``vm_name``)."""
    status: str
    not_before: datetime | None
    """When it may start; None once it has started (the field is blank then)."""

    def affects(self, vm: str) -> bool:
        return vm.lower() in (r.lower() for r in self.resources)

    def started_by(self, now: datetime) -> bool:
        """Whether its VMs may be gone at ``now``: started, or past ``NotBefore``."""
        return self.not_before is None or self.not_before <= now


def events_url(base: str = METADATA_URL) -> str:
    return f"{base.rstrip('/')}{PATH}?api-version={API_VERSION}"


def fetch(base: str = METADATA_URL, timeout_s: float = POLL_TIMEOUT_S) -> dict[str, Any]:
    """The current document (a GET with ``Metadata: true``, never through a proxy)."""
    request = urllib.request.Request(events_url(base), headers={"Metadata": "true"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def parse(document: dict[str, Any]) -> tuple[int, list[ScheduledEvent]]:
    """(DocumentIncarnation, events); ValueError when it is not the documented shape."""
    events = document.get("Events")
    incarnation = document.get("DocumentIncarnation")
    if not isinstance(events, list) or not isinstance(incarnation, int):
        raise ValueError(f"not a Scheduled Events document: {str(document)[:200]}")
    return incarnation, [_event(raw) for raw in events]


def _event(raw: dict[str, Any]) -> ScheduledEvent:
    try:
        resources = tuple(str(r) for r in raw["Resources"])
        text = str(raw.get("NotBefore") or "").strip()
        not_before = parsedate_to_datetime(text) if text else None
        return ScheduledEvent(
            str(raw["EventId"]),
            str(raw["EventType"]),
            resources,
            str(raw["EventStatus"]),
            not_before,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a Scheduled Events event ({exc}): {str(raw)[:200]}") from None


def vm_name(provider_id: str) -> str | None:
    """The name Scheduled Events gives the VM behind a Node's ``spec.providerID``."""
    if match := _SCALE_SET_VM.match(provider_id or ""):
        return f"{match['scale_set']}_{match['instance']}"
    if match := _VM.match(provider_id or ""):
        return match["name"]
    return None


def own_preempt(events: list[ScheduledEvent], vm: str) -> ScheduledEvent | None:
    """The Preempt of ``vm``, if one is scheduled or started."""
    return next((e for e in events if e.event_type == PREEMPT and e.affects(vm)), None)


def started_preempts(events: list[ScheduledEvent], now: datetime) -> list[ScheduledEvent]:
    """The Preempts of the placement group that have started by ``now``: their VMs are being
    deleted (the Spot pools' eviction policy is Delete), and what ran there runs no more."""
    return [e for e in events if e.event_type == PREEMPT and e.started_by(now)]
