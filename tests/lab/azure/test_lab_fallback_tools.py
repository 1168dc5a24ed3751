"""``lab preflight`` and ``lab prices`` with the on-demand fallback on: the regular vCPU quota of
the size's family, and the fallback's on-demand price beside Spot's. Recorded Azure answers,
replayed through the SDKs' own transport (``tests/recordings/azure``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.azure.preflight.command import main as preflight
from lab.azure.prices.command import main as prices
from tests.support.azure_replay import FakeAzure, recording, serve
from tests.support.lab_azure_fixtures import (
    USAGES,
    az_account,
    eviction_routes,
    fake_tools,
    price_routes,
    replay_azure,
    scratch_project,
    subscription_routes,
)

FALLBACK = {"onDemandMaxNodes": "2", "rdzvJoinTimeout": "1200"}
# No preflight here reaches Docker Hub: it answers from loopback.
pytestmark = pytest.mark.usefixtures("hub")


@pytest.fixture
def azure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAzure]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("PATH", str(fake_tools(tmp_path / "bin", az_account())))
    for fake in serve():
        subscription_routes(fake)
        price_routes(fake)
        eviction_routes(fake)
        yield fake


def _checks(
    fake: FakeAzure, capsys: pytest.CaptureFixture[str], project: Path
) -> tuple[int, dict[str, Any]]:
    code = preflight(["--json", "--stack", "test"], replay_azure(fake), project)
    report = json.loads(capsys.readouterr().out)
    return code, {c["name"]: c for c in report["checks"]}


def _usages(**limits: int) -> dict[str, Any]:
    usages = recording("usages.json")
    for usage in usages["value"]:
        usage["limit"] = limits.get(usage["name"]["value"], usage["limit"])
    return usages


@pytest.mark.usefixtures("processes")
def test_preflight_checks_the_fallbacks_family_quota_named_by_the_sku(
    azure: FakeAzure, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recorded subscription has 0 vCPUs of the T4 family (as new subscriptions do): the
    Spot pool fits, the on-demand fallback does not, and the check says which quota to raise."""
    code, checks = _checks(azure, capsys, scratch_project(tmp_path, **FALLBACK))
    assert code == 1
    family = checks["standardNCASv3_T4Family quota (on-demand fallback quota)"]
    assert family["status"] == "fails"
    assert family["detail"] == (
        "0 used / 0 limit, needs 8 (2 × Standard_NC4as_T4_v3 at 4 on demand)"
    )
    assert "request 'standardNCASv3_T4Family' vCPUs in westus3" in family["fix"]
    assert "spot-lab:onDemandMaxNodes" in family["fix"]
    assert checks["Spot vCPU quota"]["status"] == "ok"
    regional = checks["regional vCPU quota with the fallback"]
    assert regional["detail"] == (
        "4 used / 20 limit, needs 16 (the CPU pools' 8 + 2 × Standard_NC4as_T4_v3 at 4 on demand)"
    )


@pytest.mark.usefixtures("processes")
def test_with_the_family_quota_granted_the_fallback_passes_and_the_regional_total_counts_it(
    azure: FakeAzure, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    azure.routes[("GET", USAGES)] = (200, _usages(standardNCASv3_T4Family=8, cores=17))
    code, checks = _checks(azure, capsys, scratch_project(tmp_path, **FALLBACK))
    family = checks["standardNCASv3_T4Family quota (on-demand fallback quota)"]
    assert family["status"] == "ok"
    # 4 used + 6 for the CPU pools + 8 for the fallback = 18 > 17: the regional total fails.
    assert checks["regional vCPU quota with the fallback"]["status"] == "fails"
    assert checks["regional vCPU quota"]["status"] == "ok"  # the CPU pools alone fit
    assert code == 1
    assert "(+2 on demand)" in checks["stack config"]["detail"]


@pytest.mark.usefixtures("processes")
def test_without_the_fallback_no_regular_gpu_quota_is_asked_for(
    azure: FakeAzure, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _checks(azure, capsys, scratch_project(tmp_path))
    assert code == 0
    assert not any("fallback" in name for name in checks)


def test_prices_show_the_fallbacks_on_demand_price_beside_spots(
    azure: FakeAzure, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = scratch_project(tmp_path, **FALLBACK)
    argv = ["--stack", "test", "--hours", "10"]
    assert prices([*argv, "--json"], replay_azure(azure), project) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fallback"] == {
        "max_nodes": 2,
        "region": "westus3",
        "on_demand_usd_per_h": 0.526,
        "spot_usd_per_h": 0.0915,
        "times_spot": 5.75,
        "run_cost": pytest.approx(0.526 * 10 * 2),
    }
    assert prices(argv, replay_azure(azure), project) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[2] == (
        "On-demand fallback (onDemandMaxNodes 2): $0.5260/h a node in westus3, 5.75× the Spot "
        "price; 10 h × 2 on demand: $10.52."
    )
    header = next(line for line in text if line.startswith("#  region"))
    assert header.endswith("10 h × 3 Spot  10 h × 2 on-demand")
    westus2 = next(line for line in text if "westus2" in line)
    assert westus2.split()[-2:] == ["$2.37", "$10.52"]  # 0.0789 × 10 × 3; 0.526 × 10 × 2


def test_prices_without_the_fallback_have_no_fallback_column(
    azure: FakeAzure, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert prices(["--stack", "test"], replay_azure(azure), scratch_project(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "on-demand fallback" not in out.lower() and "× 2 on-demand" not in out
