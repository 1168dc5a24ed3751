"""``lab prices`` against recorded Retail Prices and Resource Graph answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.azure.prices.command import main
from lab.azure.prices.retail import vm_prices
from tests.support.azure_replay import FakeAzure, NoSignIn, recording, serve
from tests.support.lab_azure_fixtures import (
    GRAPH,
    PROJECT_DIR,
    RETAIL,
    eviction_routes,
    price_routes,
    replay_azure,
)


@pytest.fixture
def azure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAzure]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    for fake in serve():
        price_routes(fake)
        eviction_routes(fake)
        yield fake


def _prices(
    fake: FakeAzure, capsys: pytest.CaptureFixture[str], *flags: str, credential: Any = None
) -> dict[str, Any]:
    code = main(["--stack", "dev", "--json", *flags], replay_azure(fake, credential), PROJECT_DIR)
    assert code == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_regions_are_joined_across_both_sources_and_ranked_by_run_cost(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _prices(azure, capsys, "--hours", "10")
    rows = {r["region"]: r for r in report["regions"]}
    order = [r["region"] for r in report["regions"]]
    # Spot $/h: westus2 .0789, eastus .0863, westus3 .0915, westeurope .0934, southcentral
    # .1052, japaneast .1287; uaenorth has a band but no price, so it ranks last.
    assert order == [
        "westus2",
        "eastus",
        "westus3",
        "westeurope",
        "southcentralus",
        "japaneast",
        "uaenorth",
    ]
    assert rows["westus2"] == {
        "region": "westus2",
        "spot": 0.0789,
        "on_demand": 0.526,
        "saving": pytest.approx(1 - 0.0789 / 0.526),
        "eviction": "0-5",
        "run_cost": pytest.approx(0.0789 * 10 * 3),  # 10 h × workerMaxReplicas 3
    }
    # westus3 lists an older Spot rate too; the one in force started last.
    assert rows["westus3"]["spot"] == 0.0915
    assert rows["japaneast"]["eviction"] is None  # priced, but no band recorded
    assert rows["uaenorth"]["spot"] is None and rows["uaenorth"]["eviction"] == "20+"
    assert report["eviction_note"] == "no data"


def test_every_page_of_both_apis_is_read(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    _prices(azure, capsys)
    size_pages = [
        s for s in azure.seen if "Standard_NC4as_T4_v3" in json.dumps(s.query) and s.path == RETAIL
    ]
    assert len(size_pages) == 2 and size_pages[1].query["$skip"] == ["20"]
    assert size_pages[0].query["$filter"] == [
        "serviceName eq 'Virtual Machines' and armSkuName eq 'Standard_NC4as_T4_v3' "
        "and priceType eq 'Consumption'"
    ]
    assert size_pages[0].query["meterRegion"] == ["'primary'"]
    assert size_pages[0].authorization is None  # the price list is public
    graph = [s for s in azure.seen if s.path == GRAPH]
    assert len(graph) == 2
    assert "skuspotevictionrate" in graph[0].body["query"]
    assert (
        graph[1].body["options"]["$skipToken"] == (recording("eviction_page1.json")["$skipToken"])
    )


def test_without_a_sign_in_the_band_column_says_so_and_prices_still_print(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--stack", "dev"], replay_azure(azure, NoSignIn()), PROJECT_DIR)
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "The stack's region westus3: rank 3 of 6, Spot $0.0915/h, eviction needs az login." in out
    )
    westus2 = next(line for line in out.splitlines() if line.startswith("1 "))
    assert "westus2" in westus2 and "needs az login" in westus2
    assert not [s for s in azure.seen if s.path == GRAPH]


def test_idle_cost_comes_from_the_price_list(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    idle = _prices(azure, capsys)["idle"]
    by_name = {item["name"]: item["monthly"] for item in idle["items"]}
    assert by_name == {
        "CPU pools": pytest.approx(4 * 0.096 * 730),  # 3 system + 1 bootstrap D2s_v5
        "load balancer": pytest.approx(0.025 * 730),
        "public IP": pytest.approx(0.005 * 730),
        "registry": pytest.approx(0.1666 * 730 / 24),  # billed per day
    }
    assert idle["total"] == pytest.approx(sum(by_name.values()))


def test_a_meter_missing_from_the_list_is_shown_not_guessed(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    azure.routes[("GET", RETAIL, "serviceName eq 'Container Registry'")] = (
        200,
        {"Items": [], "NextPageLink": None, "Count": 0},
    )
    idle = _prices(azure, capsys)["idle"]
    assert next(i for i in idle["items"] if i["name"] == "registry")["monthly"] is None
    assert idle["total"] is None


def test_regions_flag_filters_both_sources(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _prices(azure, capsys, "--regions", "westus3,eastus,brazilsouth")
    assert [r["region"] for r in report["regions"]] == ["eastus", "westus3", "brazilsouth"]
    first = next(s for s in azure.seen if s.path == RETAIL)
    assert (
        "(armRegionName eq 'westus3' or armRegionName eq 'eastus' or armRegionName eq "
        in (first.query["$filter"][0])
    )


def test_answers_are_cached_and_refresh_asks_again(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _prices(azure, capsys)
    asked = len(azure.seen)
    azure.routes.clear()  # anything asked now would be a 404
    assert _prices(azure, capsys) == first
    assert len(azure.seen) == asked
    price_routes(azure)
    eviction_routes(azure)
    _prices(azure, capsys, "--refresh")
    assert len(azure.seen) == 2 * asked


def test_a_failing_price_api_is_retried_then_reported_in_one_line(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    error = {"error": {"code": "ServiceUnavailable", "message": "try later"}}
    down = (503, error, {"Retry-After": "0"})
    azure.routes = {("GET", RETAIL): down}
    code = main(["--stack", "dev"], replay_azure(azure), PROJECT_DIR)
    assert code == 1
    assert capsys.readouterr().err == "error: 503 ServiceUnavailable: try later\n"
    assert len(azure.seen) == 4  # the first try and 3 retries
    # azure-core's exponential backoff between them (Retry-After 0 asks for none of its own):
    # its first retry is at once, then each waits longer (recorded by the transport, not waited).
    assert len(azure.slept) == 2 and 0 < azure.slept[0] < azure.slept[1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vm-size", "Standard_NC6s_v3"], "--vm-size must be one of Standard_NC4as_T4_v3, "),
        (["--regions", "West US"], "--regions must be 'all' or Azure region names"),
        (["--hours", "0"], "--hours must be a number of hours > 0, got 0"),
        (["--stack", "prod"], "no stack file Pulumi.prod.yaml"),
        (["--eviction-rate", "120"], "--eviction-rate must be a percentage per node-hour from"),
        (["--target-workers", "0"], "--target-workers must be a whole number from 1 to 1000"),
        (["--probability", "1"], "--probability must be a number between 0 and 1 (exclusive)"),
        (["--replacement-minutes", "0"], "--replacement-minutes must be minutes > 0"),
        (["--step-seconds", "-2"], "--step-seconds must be seconds > 0; got -2"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(
    flags: list[str], message: str, azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--stack", "dev", *flags], replay_azure(azure), PROJECT_DIR) == 2
    assert message in capsys.readouterr().err
    assert azure.seen == []


def test_linux_on_demand_and_spot_only() -> None:
    items = recording("prices_d2s_v5_westus3.json")["Items"]
    assert [(p.region, p.spot, p.on_demand) for p in vm_prices(items)] == [
        ("westus3", 0.0115, 0.096)
    ]


def test_a_meter_priced_for_all_regions_counts_and_a_regional_price_wins(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    # The load balancer's included rules are listed once, under armRegionName "Global".
    idle = _prices(azure, capsys)["idle"]
    assert next(i for i in idle["items"] if i["name"] == "load balancer")["monthly"] == (
        pytest.approx(0.025 * 730)
    )
    lb = next(s for s in azure.seen if "Load Balancer" in s.query["$filter"][0])
    assert "(armRegionName eq 'westus3' or armRegionName eq 'Global')" in lb.query["$filter"][0]
    answer = recording("prices_load_balancer.json")
    answer["Items"].append(answer["Items"][0] | {"armRegionName": "westus3", "retailPrice": 0.03})
    azure.routes[("GET", RETAIL, "serviceName eq 'Load Balancer'")] = (200, answer)
    idle = _prices(azure, capsys, "--refresh")["idle"]
    assert next(i for i in idle["items"] if i["name"] == "load balancer")["monthly"] == (
        pytest.approx(0.03 * 730)
    )


def test_headroom_for_the_stacks_world_size_from_the_regions_band(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    room = _prices(azure, capsys, "--step-seconds", "2")["headroom"]
    # westus3's band 10-15 % counts as 15 % a node-hour; 11 min to replace: p = 2.7 %.
    p = 0.15 * 11 / 60 / (1 + 0.15 * 11 / 60)
    assert room["eviction_rate_pct"] == 15 and room["unavailability"] == pytest.approx(p)
    assert room["target"] == 3  # the dev stack's workerMaxReplicas
    assert room["without_headroom"] == pytest.approx((1 - p) ** 3)  # 92 %: short of 95 %
    assert room["workers"] == 4 and room["achieved"] >= 0.95
    assert room["expected_missing"] == pytest.approx(4 * p)
    # 2 s a step at 3 workers: 6 node-seconds a step at Spot's $0.0915 and on demand's $0.526.
    assert room["spot_usd_per_1000_steps"] == pytest.approx(1000 * 6 / 3600 * 0.0915)
    assert room["on_demand_usd_per_1000_steps"] == pytest.approx(1000 * 6 / 3600 * 0.526)
    assert room["on_demand_hours_per_1000_steps"] == pytest.approx(2000 / 3600)
    assert room["spot_hours_per_1000_steps"] == pytest.approx(6000 / (4 * (1 - p)) / 3600)


def test_the_headroom_lines_of_the_table(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--stack", "dev", "--step-seconds", "2", "--target-workers", "8"]
    assert main([*flags, "--probability", "0.99"], replay_azure(azure), PROJECT_DIR) == 0
    out = capsys.readouterr().out
    lines = out[out.index("Headroom in westus3") :].splitlines()
    assert lines[0] == (
        "Headroom in westus3 (eviction 15 % a node-hour, the upper end of the band 10-15 %; "
        "replacement 11 min, the documented estimate (docs/azure.md)):"
    )
    assert (
        lines[1]
        == "  a worker is missing 2.7% of the time; with no headroom 8 train 80.5% of the time."
    )
    assert lines[2] == (
        "  To keep 8 training 99% of the time, ask for 10: workerMaxReplicas 10 (the GPU pool "
        "follows it; or gpuMaxNodes 10)."
    )
    assert lines[3].startswith("  With 10: 8 or more train 99.")
    assert lines[4] == (
        "  1,000 steps (2 s a step at 8 workers): Spot with 10 $0.41 in 0.46 h; on demand with 8 "
        "$2.34 in 0.56 h."
    )
    assert "a wave (many Spot VMs reclaimed at once) is not covered" in lines[5]


def test_headroom_from_a_measured_replacement_and_a_given_rate(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--eviction-rate", "5", "--replacement-minutes", "4", "--target-workers", "16")
    room = _prices(azure, capsys, *flags)["headroom"]
    assert (room["rate_source"], room["replacement_source"]) == (
        "--eviction-rate",
        "--replacement-minutes",
    )
    assert room["workers"] == 17 and "spot_usd_per_1000_steps" not in room


def test_without_a_band_the_headroom_asks_for_a_rate(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--stack", "dev"], replay_azure(azure, NoSignIn()), PROJECT_DIR)
    assert code == 0
    assert (
        "Headroom in westus3 to keep 3 training 95% of the time: no eviction rate (needs az "
        "login): pass --eviction-rate." in capsys.readouterr().out
    )


def test_the_replacement_time_from_a_drills_report(
    azure: FakeAzure, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Two replacements took 5 and 7 minutes to a step at full size, a third never got there:
    the median of those that did, 6 minutes."""

    def fault(last: float | None) -> dict[str, Any]:
        steps = [{"step": "eviction requested", "since_eviction_s": 0.0}]
        steps.append({"step": "first step at full size", "since_eviction_s": last})
        return {"kind": "evict", "replacement_steps": {"steps": steps}}

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"faults": [fault(300.0), fault(420.0), fault(None)]}))
    room = _prices(azure, capsys, "--replacement-from", str(report))["headroom"]
    assert room["replacement_min"] == 6.0
    assert room["replacement_source"] == "the median of 2 in report.json"
    p = 0.15 * 0.1 / (1 + 0.15 * 0.1)
    assert room["unavailability"] == pytest.approx(p)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--replacement-from must be a drill's report.json: "),
        ("not json", "--replacement-from must be a drill's report.json: "),
        ('{"faults": []}', "no replacement reached full size in that report"),
    ],
)
def test_a_report_without_a_replacement_is_refused(
    content: str | None,
    message: str,
    azure: FakeAzure,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    argv = ["--stack", "dev", "--replacement-from", str(path)]
    assert main(argv, replay_azure(azure), PROJECT_DIR) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert azure.seen == []
