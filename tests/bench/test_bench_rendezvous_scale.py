"""``python -m bench rendezvous-scale``: the model (pure), the parsing, and one small real run."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from bench.cli import main as bench_main
from bench.rendezvous_scale import command, etcd_metrics, model, tables


# -- the model -----------------------------------------------------------------------------------
def test_a_line_is_fitted_by_least_squares() -> None:
    line = model.fit_line([(8, 1.0 + 0.01 * 8), (32, 1.0 + 0.01 * 32), (64, 1.0 + 0.01 * 64)])
    assert line.a == pytest.approx(1.0) and line.b == pytest.approx(0.01)
    noisy = model.fit_line([(8, 1.0), (32, 1.4), (64, 1.3)])
    assert noisy.b > 0 and noisy.at(1024) > 1.4  # through the middle, still growing


def test_a_falling_line_is_taken_as_flat() -> None:
    line = model.fit_line([(8, 2.0), (64, 1.0)])
    assert line == model.Line(1.5, 0.0)


def test_one_node_count_cannot_calibrate_growth() -> None:
    with pytest.raises(ValueError, match="two node counts"):
        model.fit_line([(8, 1.0), (8, 1.2)])
    with pytest.raises(ValueError, match="two node counts"):
        model.fit_quadratic([(8, 100.0)])


def test_requests_per_reform_are_fitted_as_n_squared() -> None:
    quad = model.fit_quadratic([(n, 3 * n + 0.5 * n * n) for n in (8, 32, 64)])
    assert quad.b == pytest.approx(3) and quad.c == pytest.approx(0.5)
    linear = model.fit_quadratic([(8, 80.0), (32, 200.0), (64, 330.0)])  # concave: no N^2 term
    assert linear.c == 0 and linear.b > 0


def test_the_quiet_load_of_the_design_is_a_keep_alive_and_a_watch_stream_per_agent() -> None:
    # 1 lease keep-alive per interval + 1 new watch stream per 5 quiet intervals, no read.
    assert model.expected_quiet_req_s(10, 1.0) == pytest.approx(12.0)
    assert model.expected_quiet_req_s(10, 2.0) == pytest.approx(6.0)


def test_a_reform_of_the_design_is_three_requests_per_survivor_and_the_keep_alives() -> None:
    # 9 survivors: 3 each (open the round, lease grant, join), 2 for the completer, and
    # 9 keep-alives a second for 2 s.
    assert model.expected_reform_requests(10, 2.0, 1.0) == pytest.approx(27 + 4 + 18)


def _points() -> list[model.Point]:
    return [
        model.Point(
            n, 1.0 + 0.002 * n, 0.2 + 0.01 * n, 0.1 + 0.01 * n, 1.4 * n, 2 * n + n * n, 1e-6 * n * n
        )
        for n in (8, 32, 64)
    ]


def test_a_calibrated_model_predicts_larger_n_and_says_what_it_assumes() -> None:
    cal = model.calibrate(_points(), 1.0)
    row = model.predict(cal, 1024)
    assert row["source"] == "model" and row["false_deaths"] is None
    assert row["first_round_s"] == pytest.approx(1.0 + 0.002 * 1024)
    assert row["reform_death_s"] == pytest.approx(0.2 + 10.24)
    # 1,024 agents beat every 16 s at most (the stack's 64 heartbeats a second).
    assert row["keep_alive_interval_s"] == 16
    assert row["quiet_req_s"] == pytest.approx(1.4 * 1024 / 16, abs=0.1)
    assert row["expected_quiet_req_s"] == pytest.approx(1.2 * 1024 / 16, abs=0.1)
    assert row["reform_requests"] == 2 * 1024 + 1024**2
    assert row["reform_req_s"] == pytest.approx(
        row["reform_requests"] / row["reform_death_s"], 1e-3
    )
    assert row["reform_etcd_cpu_s"] == pytest.approx(1e-6 * 1024**2, abs=1e-3)
    assert row["reform_etcd_cores"] == pytest.approx(1.049 / 10.44, abs=0.01)
    assert row["expected_reform_requests"] == round(3 * 1023 + 4 + 1023 * 10.44 / 16)
    text = " ".join(model.assumptions(cal))
    assert "N = 8, 32, 64" in text and "N^2" in text and "not modelled" in text
    assert "lease keep-alive" in text and "watch" in text


def test_a_reform_takes_at_least_etcds_cpu_for_it_on_one_core() -> None:
    points = [
        model.Point(n, 1.0, 0.2 + 0.001 * n, 0.2, 1.2 * n, 3.0 * n, 1e-5 * n * n)
        for n in (8, 32, 64)
    ]
    row = model.predict(model.calibrate(points, 1.0), 1024)
    assert row["reform_death_s"] == pytest.approx(1e-5 * 1024**2 / model.ETCD_CORES, abs=1e-3)
    assert row["reform_etcd_cores"] == pytest.approx(model.ETCD_CORES)


def test_a_reform_shares_etcds_core_with_the_work_between_rounds() -> None:
    # Quiet cores 0.0005 an agent: at 1024, 0.512 of the core is the keep-alives', so the
    # re-form's own CPU runs on the rest.
    points = [
        model.Point(n, 1.0, 0.2, 0.2, 1.2 * n, 3.0 * n, 1e-5 * n * n, 0.008 * n)
        for n in (8, 32, 64)
    ]
    row = model.predict(model.calibrate(points, 1.0), 1024)  # beats every 16 s
    free = 1.0 - 0.008 * 1024 / 16
    assert row["reform_death_s"] == pytest.approx(1e-5 * 1024**2 / free, rel=1e-3)
    assert row["reform_etcd_cores"] == pytest.approx(1.0)
    busy = [replace(p, quiet_etcd_cores=0.02 * p.nodes) for p in points]
    saturated = model.predict(model.calibrate(busy, 1.0), 1024)  # 1.28 cores at 16 s
    assert saturated["saturated"] and saturated["reform_death_s"] is None


def test_the_bench_models_only_beyond_its_largest_complete_count() -> None:
    def measured(n: int, death: float | None) -> dict[str, object]:
        def med(value: float | None) -> dict[str, float] | None:
            return None if value is None else {"median": value}

        summary = {
            "first_round_s": med(1.0),
            "reform_death_s": med(death),
            "reform_leave_s": med(0.3),
            "quiet_req_s": med(1.4 * n),
            "reform_requests": med(float(n * n)),
            "reform_etcd_cpu_s": med(0.01 * n),
        }
        return {"nodes": n, "summary": summary}

    fitted = tables.build_model([measured(8, 0.3), measured(32, 0.5)], 1.0, (16, 128, 256))
    assert [row["nodes"] for row in fitted["rows"]] == [128, 256]
    assert "error" in tables.build_model([measured(8, 0.3), measured(32, None)], 1.0, (128,))


# -- etcd's metrics and the table ----------------------------------------------------------------
METRICS = """\
# HELP grpc_server_started_total Total number of RPCs started on the server.
# TYPE grpc_server_started_total counter
grpc_server_started_total{grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 120
grpc_server_started_total{grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 25
grpc_server_started_total{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease"} 5
grpc_server_started_total{grpc_method="Watch",grpc_service="etcdserverpb.Watch"} 7
grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV"} 999
etcd_mvcc_range_total 20
etcd_mvcc_put_total 22
etcd_mvcc_delete_total 3
etcd_debugging_lease_revoked_total 1
process_cpu_seconds_total 2.5
"""


def test_etcds_counters_are_summed_over_their_labels() -> None:
    assert etcd_metrics.parse_metrics(METRICS) == {
        "received": 150.0,
        "reads": 20.0,
        "writes": 25.0,
        "watches": 7.0,
        "expires": 1.0,
        "etcd_cpu_s": 2.5,
    }


def test_etcd_requests_are_the_received_ones_plus_the_watches_it_leaves_out() -> None:
    before = {**etcd_metrics.parse_metrics(METRICS), "at": 100.0}
    after = {**before, "received": 330.0, "watches": 27.0, "etcd_cpu_s": 3.0, "at": 110.0}
    rates = etcd_metrics.etcd_rates(before, after)
    assert rates["requests"] == 200 and rates["req_s"] == 20.0
    assert rates["etcd_cpu_share"] == 0.05 and rates["seconds"] == 10.0


def test_the_table_marks_what_was_not_measured_or_modelled() -> None:
    rows = [
        {"nodes": 8, "source": "measured", "first_round_s": 1.2, "reform_death_s": None,
         "reform_leave_s": 0.3, "false_deaths": 0, "keep_alive_interval_s": 1.0,
         "freeze_found_s": 5.0, "quiet_req_s": 11.2, "reform_req_s": 900.0,
         "reform_etcd_cores": 0.25},
        {"nodes": 1024, "source": "model", "first_round_s": 3.0, "reform_death_s": 9.0,
         "reform_leave_s": 8.0, "false_deaths": None, "keep_alive_interval_s": 16,
         "quiet_req_s": 1433.6, "reform_req_s": 1e5, "reform_etcd_cores": None},
    ]  # fmt: skip
    lines = tables.table_text(rows).splitlines()
    assert lines[0].split()[:2] == ["N", "source"] and set(lines[1]) <= {"-", " "}
    assert lines[2].split() == [
        "8", "measured", "1.20", "-", "0.30", "0", "1", "5", "11.2", "900", "0.25", "-"
    ]  # fmt: skip
    assert lines[3].split()[5] == "n/a" and lines[3].split()[-1] == "n/a"


def test_a_modelled_size_reports_when_a_freeze_is_found_at_its_heartbeat() -> None:
    # 1,024 agents beat every 16 s (at most 64 heartbeats a second): a frozen node's key
    # lives 5 heartbeats, 80 s, whatever the re-form's own time.
    points = [
        model.Point(n, 0.01 * n, 0.004 * n, 0.004 * n, 1.2 * n, 3 * n, 0.002 * n, 0.001 * n)
        for n in (8, 16, 32)
    ]
    row = model.predict(model.calibrate(points, 1.0), 1024)
    assert (row["keep_alive_interval_s"], row["freeze_found_s"]) == (16, 80)
    assert model.freeze_found_s(1.0) == 5


@pytest.fixture
def signals_restored() -> Iterator[None]:
    """The command installs its own signal handlers; pytest gets its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_bad_flags_exit_2_before_anything_starts(
    signals_restored: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_main(["rendezvous-scale", "--nodes", "2,8"]) == command.BAD_INPUT
    assert ">= 3" in capsys.readouterr().err


# -- one real run --------------------------------------------------------------------------------
@pytest.mark.usefixtures("processes")
def test_four_agents_in_two_processes_form_reform_and_die_no_false_death(
    tmp_path: Path, signals_restored: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--nodes", "4", "--reps", "1", "--quiet-s", "3", "--per-process", "2"]
    assert bench_main(["rendezvous-scale", *argv, "--out", str(out)]) == command.OK
    results = json.loads((out / "rendezvous-scale.json").read_text())
    (measured,) = results["measured"]
    assert measured["processes"] == 2
    (rep,) = measured["reps"]
    assert rep["error"] is None and rep["false_deaths"] == 0
    assert rep["quiet"]["false_deaths"] == 0 and rep["quiet"]["etcd"]["requests"] > 0
    assert [rep[p]["agents"] for p in ("first", "death", "leave")] == [4, 3, 2]
    for phase in ("first", "death", "leave"):
        assert rep[phase]["seconds"] > 0 and rep[phase]["live_left_out"] == 0
        assert rep[phase]["dead_included"] == 0 and rep[phase]["etcd"]["requests"] > 0
    # 4 agents for 3 s: 12 lease keep-alives, and watches on top of etcd's own count.
    quiet = rep["quiet"]["etcd"]
    assert quiet["requests"] == quiet["received"] + quiet["watches"] >= 12
    # The killed agent is dropped on its refused probe, not after its key's 2 s TTL.
    assert rep["death"]["seconds"] < 2.0
    (row,) = results["rows"]  # one count: nothing to calibrate a model on
    assert row["source"] == "measured" and row["false_deaths"] == 0
    assert all(row[k] is not None for k in ("first_round_s", "reform_death_s", "quiet_req_s"))
    assert "error" in results["model"]
    assert "first round s" in capsys.readouterr().out
