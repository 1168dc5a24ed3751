"""Spot eviction-rate bands per region, from Azure Resource Graph's ``SpotResources`` table.

Azure publishes, per size and region, the band of the hourly eviction rate of its Spot VMs
over the last days ("0-5", "5-10", "10-15", "15-20", "20+" percent), as resources of type
``microsoft.compute/skuspotevictionrate/location`` (Azure docs, "Use Azure Spot Virtual
Machines": the eviction-rate query of Azure Resource Graph). Reading it needs a sign-in; the
query runs over every subscription the caller can read.
"""

from __future__ import annotations

import time

from lab.azure.clients import ARM, Azure, azure_errors
from lab.azure.prices.cache import ApiCache

TTL_S = 3600  # Azure refreshes the bands often; an hour-old band is still the same band
MAX_PAGES = 20


def query(vm_size: str) -> str:
    """The Kusto query for one size's bands (size names compare case-insensitively)."""
    size = vm_size.replace("'", "")
    return (
        "SpotResources\n"
        "| where type =~ 'microsoft.compute/skuspotevictionrate/location'\n"
        f"| where sku.name =~ '{size}'\n"
        "| project location = tostring(location), "
        "evictionRate = tostring(properties.evictionRate)"
    )


def band_floor(band: str | None) -> float:
    """The lower bound of a band, for ordering ("20+" -> 20; unknown sorts last)."""
    try:
        return float((band or "").split("-")[0].rstrip("+"))
    except ValueError:
        return float("inf")


def eviction_bands(azure: Azure, cache: ApiCache, vm_size: str) -> tuple[dict[str, str], float]:
    """{region: band} for ``vm_size``, and when it was read."""

    def load() -> dict:
        from azure.mgmt.resourcegraph.models import QueryRequest, QueryRequestOptions

        azure.probe(ARM)
        rows: list[dict] = []
        skip_token: str | None = None
        with azure_errors(), azure.resource_graph() as graph:
            for _ in range(MAX_PAGES):
                options = QueryRequestOptions(result_format="objectArray", skip_token=skip_token)
                answer = graph.resources(QueryRequest(query=query(vm_size), options=options))
                rows.extend(answer.data or [])
                skip_token = answer.skip_token
                if not skip_token:
                    break
        return {"rows": rows, "taken_at": time.time()}

    value = cache.fetch(f"eviction:{vm_size.lower()}", TTL_S, load)
    bands = {
        str(row["location"]).lower(): str(row["evictionRate"])
        for row in value["rows"]
        if row.get("location") and row.get("evictionRate")
    }
    return bands, value["taken_at"]
