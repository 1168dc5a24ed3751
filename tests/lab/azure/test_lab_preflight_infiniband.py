"""``lab preflight``'s InfiniBand line: whether the GPU size has it (the catalogue) and whether the
region offers it with the size (its Resource SKU's ``RdmaEnabled`` capability, deserialized by
the SDK's own model from the API's shape)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from azure.mgmt.compute.models import ResourceSku

from lab.azure.preflight.context import FAILS, OK
from lab.azure.preflight.infiniband import check_infiniband
from stack_config import load

ND = "Standard_ND96asr_v4"


def _sku(rdma: str | None) -> ResourceSku:
    capabilities = [
        {"name": "vCPUs", "value": "96"},
        {"name": "LowPriorityCapable", "value": "True"},
    ]
    if rdma is not None:
        capabilities.append({"name": "RdmaEnabled", "value": rdma})
    body = {
        "resourceType": "virtualMachines",
        "name": ND,
        "locations": ["eastus"],
        "capabilities": capabilities,
        "restrictions": [],
    }
    return ResourceSku(body)


def _line(raw: dict[str, str], skus: dict[str, Any]) -> Any:
    cfg = load({"location": "eastus", **raw}, "spot-lab", "dev")
    (check,) = check_infiniband(SimpleNamespace(cfg=cfg, skus=skus))  # type: ignore[arg-type]
    return check


def test_an_nd_size_the_region_offers_rdma_enabled_is_used() -> None:
    check = _line({"gpuVmSize": ND}, {ND.lower(): _sku("True")})
    assert check.status == OK
    assert check.detail == (
        f"{ND} has 8 × 200 Gb/s; eastus offers it (RdmaEnabled); the workers use it"
    )


@pytest.mark.parametrize("rdma", ["False", None])
def test_a_region_without_rdma_for_the_size_fails_and_says_how(rdma: str | None) -> None:
    check = _line({"gpuVmSize": ND}, {ND.lower(): _sku(rdma)})
    assert check.status == FAILS
    assert "eastus does not list it RdmaEnabled" in check.detail
    assert check.fix == f"a region whose {ND} is RDMA-enabled, or spot-lab:rdma off"


def test_a_size_without_infiniband_or_rdma_off_says_nccl_uses_ethernet() -> None:
    t4 = _line({}, {})
    assert (t4.status, t4.detail) == (
        OK,
        "Standard_NC4as_T4_v3 has none: NCCL uses TCP over Ethernet",
    )
    off = _line({"gpuVmSize": ND, "rdma": "off"}, {})
    assert off.status == OK and off.detail.endswith(
        "off (spot-lab:rdma): NCCL uses TCP over Ethernet"
    )
