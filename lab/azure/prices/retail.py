"""Azure Retail Prices API: list prices of VM sizes and of the lab's fixed resources.

Public, no sign-in. Answers are pages of ``Items`` linked by ``NextPageLink``; filters are
OData, case-sensitive since API version 2023-01-01-preview, and ``meterRegion='primary'``
keeps only each meter's primary region, so a region has one price per meter (Azure Retail
Prices overview, learn.microsoft.com/rest/api/cost-management/retail-prices/azure-retail-prices).
Prices are USD retail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from azure.core import PipelineClient

from lab.azure.clients import AzureError, get_json
from lab.azure.prices.cache import ApiCache

PATH = "/api/retail/prices"
API_VERSION = "2023-01-01-preview"
TTL_S = 12 * 3600  # list prices change at most daily
HOURS_PER_MONTH = 730  # Azure's pricing calculator month
GLOBAL = "Global"  # the armRegionName of meters priced the same everywhere
MAX_PAGES = 100  # one size in every region is a few pages; more means a filter went wrong


@dataclass(frozen=True)
class VmPrice:
    """Linux list prices of one VM size in one region, USD per hour."""

    region: str
    spot: float | None
    on_demand: float | None

    @property
    def saving(self) -> float | None:
        """Spot's discount on the on-demand price, 0..1."""
        if self.spot is None or not self.on_demand:
            return None
        return 1 - self.spot / self.on_demand


@dataclass(frozen=True)
class Answer:
    """API items and when they were fetched (from the cache, that is when they were stored)."""

    items: list[dict]
    taken_at: float


def odata_filter(**equal: str | list[str]) -> str:
    """``a eq 'x' and (b eq 'y' or b eq 'z')`` from field=value(s), quotes escaped."""
    clauses = []
    for name, value in equal.items():
        values = [value] if isinstance(value, str) else value
        terms = [f"{name} eq '{v.replace(chr(39), chr(39) * 2)}'" for v in values]
        clauses.append(terms[0] if len(terms) == 1 else "(" + " or ".join(terms) + ")")
    return " and ".join(clauses)


class RetailPrices:
    """Queries of the Retail Prices API, paged and cached."""

    def __init__(
        self, client: PipelineClient, cache: ApiCache, probe: Callable[[], None] = lambda: None
    ) -> None:
        self._client = client
        self._cache = cache
        self._probe = probe
        """Called before the first request the cache cannot answer (``Azure.probe``)."""

    def items(self, odata: str) -> Answer:
        """Every item matching the filter, following ``NextPageLink`` to the last page."""

        def load() -> dict:
            url = (
                f"{PATH}?api-version={API_VERSION}&meterRegion='primary'"
                f"&$filter={quote(odata, safe=chr(39))}"
            )
            self._probe()
            items: list[dict] = []
            for _ in range(MAX_PAGES):
                page = get_json(self._client, url)
                items.extend(page.get("Items") or [])
                url = page.get("NextPageLink") or ""
                if not url:
                    return {"items": items, "taken_at": time.time()}
            raise AzureError(f"the Retail Prices API gave more than {MAX_PAGES} pages for {odata}")

        value = self._cache.fetch(f"retail:{odata}", TTL_S, load)
        return Answer(value["items"], value["taken_at"])

    def vm_prices(self, vm_size: str, regions: list[str] | None) -> tuple[list[VmPrice], float]:
        """Spot and on-demand Linux prices of ``vm_size`` per region (all regions: None)."""
        where: dict[str, str | list[str]] = {
            "serviceName": "Virtual Machines",
            "armSkuName": vm_size,
            "priceType": "Consumption",
        }
        if regions:
            where["armRegionName"] = regions
        answer = self.items(odata_filter(**where))
        return vm_prices(answer.items), answer.taken_at

    def meter_price(
        self, region: str, service: str, sku: str, meter: str
    ) -> tuple[float, str] | None:
        """(USD, unit) of one meter of a service in a region, or None if not listed.

        Some meters are priced once for every region, under ``armRegionName`` "Global" (the
        Standard load balancer's included rules are): the region's own price wins if both.
        """
        where = {
            "serviceName": service,
            "armRegionName": [region, GLOBAL],
            "priceType": "Consumption",
        }
        found = {
            item.get("armRegionName"): item
            for item in self.items(odata_filter(**where)).items
            if item.get("skuName") == sku and item.get("meterName") == meter
        }
        item = found.get(region) or found.get(GLOBAL)
        return None if item is None else (float(item["retailPrice"]), str(item["unitOfMeasure"]))


def _is_linux(item: dict) -> bool:
    # A size has a Linux product ("Virtual Machines NCasT4_v3 Series") and a Windows one
    # ("... Series Windows"), each with an on-demand, a Spot and a Low Priority meter.
    return not str(item.get("productName", "")).endswith("Windows")


def vm_prices(items: list[dict]) -> list[VmPrice]:
    """Join a size's items into one Linux (Spot, on-demand) pair per region."""
    newest: dict[tuple[str, str], dict] = {}
    for item in items:
        sku = str(item.get("skuName", ""))
        if not _is_linux(item) or item.get("unitOfMeasure") != "1 Hour" or "Low Priority" in sku:
            continue
        kind = "spot" if sku.endswith(" Spot") else "on_demand"
        key = (str(item.get("armRegionName", "")), kind)
        # A price change lists both rates; the one in force started last.
        if key not in newest or item.get("effectiveStartDate", "") > newest[key].get(
            "effectiveStartDate", ""
        ):
            newest[key] = item
    regions = sorted({region for region, _ in newest if region})
    return [
        VmPrice(
            region,
            spot=_price(newest.get((region, "spot"))),
            on_demand=_price(newest.get((region, "on_demand"))),
        )
        for region in regions
    ]


def _price(item: dict | None) -> float | None:
    return None if item is None else float(item["retailPrice"])


def monthly(price: float, unit: str) -> float:
    """A price per "1 Hour" or "1/Day" as USD per month."""
    if unit == "1 Hour":
        return price * HOURS_PER_MONTH
    if unit == "1/Day":
        return price * HOURS_PER_MONTH / 24
    raise AzureError(f"unexpected price unit {unit!r} in the Retail Prices API")
