"""The benchmark's pure parts: profiles, scenarios, statistics, stages, targets and tables."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench.cli import build_parser, config_from_args
from bench.profiles import baseline_profile, lab_profile, profile
from bench.recovery import measure_run, session_order, summarize_recovery
from bench.scenarios import (
    RecoveryPlan,
    SteadyPlan,
    recovery_scenario,
    steady_scenario,
    steady_train,
)
from bench.stages import recovery_stages
from bench.stats import ratio, summarize
from bench.steady_state import pair_ratios, static_command, step_times, summarize_steady
from bench.tables import breakdown_table, format_seconds, recovery_table, targets_table
from bench.targets import explain, recovery_targets, steady_target
from lab.report.outcomes import build_report
from stack_config.model import JobConfig
from training.elastic.launch import RendezvousSettings
from training.loop.config import parse_config
from training.records import CHECKPOINT_SAVED, EMERGENCY_SAVE, PEER_FAILURE, READY, RESUMED


# -- profiles and scenarios -----------------------------------------------------------------
def test_baseline_is_torchruns_defaults_without_emergency_saves() -> None:
    base = baseline_profile()
    assert base.rendezvous.conf() == {
        "last_call_timeout": "30",
        "keep_alive_interval": "5",
        "keep_alive_max_attempt": "3",
        "join_timeout": "600",
    }
    assert base.emergency_saves is False
    assert base.collective_timeout_s == 1800
    assert base.launcher == "torchrun"


def test_lab_profile_uses_the_launch_defaults() -> None:
    lab = lab_profile()
    assert lab.rendezvous == RendezvousSettings()
    assert lab.emergency_saves is True
    assert lab.collective_timeout_s == JobConfig().collective_timeout_s == 30  # the cluster's
    assert lab.launcher == "warm"


def test_unknown_profile_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="allowed: baseline, lab"):
        profile("fast")


def test_a_baseline_session_passes_the_profile_to_the_training_program() -> None:
    scenario = recovery_scenario("kill", baseline_profile(), RecoveryPlan())
    args = scenario.train.args("/data")
    assert "--emergency-saves=false" in args
    assert "--collective-timeout-s=1800" in args
    assert "--checkpoint-every-steps=20" in args
    assert "--log-every=1" in args
    assert scenario.rendezvous == baseline_profile().rendezvous
    (fault,) = scenario.faults
    assert (fault.kind, fault.node, fault.at_step) == ("kill", 0, 30)
    assert scenario.settle_timeout_s == RecoveryPlan().recovery_cap_s
    assert scenario.stop_when_settled
    # The training program accepts exactly these flags.
    cfg = parse_config([*args, "--checkpoint-uri=/ckpt"], env={})
    assert cfg.checkpoint.emergency_saves is False
    assert cfg.run.collective_timeout_s == 1800


def test_a_join_starts_one_node_short_of_max() -> None:
    scenario = recovery_scenario("join", lab_profile(), RecoveryPlan(nodes=3))
    assert (scenario.nodes, scenario.max_nodes) == (2, 3)
    assert scenario.faults[0].kind == "join" and scenario.faults[0].node is None
    assert "--emergency-saves=true" in scenario.train.args("/data")


def test_losses_start_full_and_evictions_get_their_grace() -> None:
    plan = RecoveryPlan(nodes=3, eviction_grace_s=7.0)
    scenario = recovery_scenario("evict", lab_profile(), plan)
    assert (scenario.nodes, scenario.max_nodes, scenario.min_nodes) == (3, 3, 1)
    assert scenario.faults[0].grace_s == 7.0


def test_bad_plans_name_the_setting() -> None:
    with pytest.raises(ValueError, match="fault kind 'crash' is unknown; allowed: kill"):
        recovery_scenario("crash", lab_profile(), RecoveryPlan())
    with pytest.raises(ValueError, match="fault_at_step"):
        recovery_scenario("kill", lab_profile(), RecoveryPlan(fault_at_step=10))
    with pytest.raises(ValueError, match="recovery nodes must be >= 2"):
        recovery_scenario("kill", lab_profile(), RecoveryPlan(nodes=1))
    with pytest.raises(ValueError, match="warmup_steps"):
        steady_scenario(SteadyPlan(max_steps=10, warmup_steps=9), lab_profile())


def test_steady_runs_differ_only_in_checkpoints() -> None:
    plan = SteadyPlan()
    elastic = steady_scenario(plan, lab_profile())
    assert elastic.faults == () and elastic.nodes == plan.nodes
    # Every step at the static run's size: no round of fewer nodes before the last one is up.
    assert elastic.min_nodes == elastic.max_nodes == plan.nodes
    assert f"--checkpoint-every-steps={plan.checkpoint_every_steps}" in elastic.train.args("/d")
    static = steady_train(plan, lab_profile(), checkpoints=False).args("/d")
    assert "--checkpoint-every-steps=0" in static and "--emergency-saves=false" in static
    command = static_command(plan, ["--max-steps=5"], "/py")
    assert command[:5] == [
        "/py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
    ]
    assert command[5:] == ["--module", "training.train", "--max-steps=5"]


def test_profiles_alternate_which_runs_first() -> None:
    assert session_order(0) == ("baseline", "lab")
    assert session_order(1) == ("lab", "baseline")


# -- statistics -----------------------------------------------------------------------------
def test_summarize_gives_median_min_max() -> None:
    s = summarize([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"], s["no_recovery"]) == (2.0, 1.0, 3.0, 3, 0)
    assert s["at_least"] is False and s["censored_at_s"] is None


def test_runs_without_recovery_count_as_the_cap_and_are_flagged() -> None:
    one = summarize([5.0, None, 7.0], cap_s=60.0)
    assert (one["median"], one["max"], one["no_recovery"]) == (7.0, 60.0, 1)
    assert one["at_least"] is False  # the median is a measured run
    two = summarize([5.0, None, None], cap_s=60.0)
    assert (two["median"], two["at_least"], two["censored_at_s"]) == (60.0, True, 60.0)
    with pytest.raises(ValueError, match="cap_s"):
        summarize([None])


def test_ratio_is_flagged_as_a_lower_bound_and_refuses_a_bound_denominator() -> None:
    capped = summarize([None, None], cap_s=60.0)
    lab = summarize([6.0])
    assert ratio(capped, lab) == {"value": 10.0, "at_least": True}
    assert ratio(lab, capped)["value"] is None


# -- stages, from the lab's own report ------------------------------------------------------
def _record(ts: float, node: str, kind: str = "event", **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "node": node, "kind": kind, "rank": 0, **fields}


def _metrics(ts: float, step: int, world: int, node: str = "node-0") -> dict[str, Any]:
    return _record(ts, node, "metrics", step=step, world_size=world, loss=1.0, samples_per_s=1.0)


def _lost_node_logs() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """node-0 trains at world 3, node-2 is killed at 100.2; node-1 leads the new round."""
    phases = {"spawn_and_import_s": 0.8, "build_s": 0.9, "process_group_s": 0.3}
    records = [
        _metrics(99.9, 29, 3),
        _metrics(100.0, 30, 3),
        _record(100.5, "node-1", event=PEER_FAILURE, step=30),
        _record(100.6, "node-1", event=EMERGENCY_SAVE, step=30),
        _record(105.0, "node-1", event=RESUMED, step=30, source="local", lost_steps=0),
        _record(105.01, "node-1", event=READY, step=30, seconds=2.0, phases=phases),
        _metrics(105.1, 31, 2, "node-1"),
        _metrics(105.2, 32, 2, "node-1"),
    ]
    injection = {"index": 0, "kind": "kill", "injected_at": 100.2, "planned_world_size": 2}
    return records, [injection]


def test_stages_add_up_to_the_downtime_the_lab_reports() -> None:
    records, injections = _lost_node_logs()
    report = build_report(
        records, injections, start_ts=90.0, global_batch_size=32, max_steps=100, planned_faults=1
    )
    (fault,) = report["faults"]
    stages = recovery_stages(fault, records)
    assert stages is not None
    assert stages["detect_s"] == pytest.approx(0.3)
    assert stages["rendezvous_s"] == pytest.approx(103.01 - 100.5)  # ready.ts - ready.seconds
    assert stages["startup_s"] == 2.0
    assert stages["first_step_s"] == pytest.approx(0.09)
    parts = sum(stages[k] for k in ("detect_s", "rendezvous_s", "startup_s", "first_step_s"))
    assert parts == pytest.approx(fault["downtime_s"], abs=0.002)
    assert stages["phases"] == {"spawn_and_import_s": 0.8, "process_group_s": 0.3, "build_s": 0.9}
    assert stages["paused_s"] == pytest.approx(105.1 - 100.0)  # last step at 3 -> first at 2


def test_without_a_peer_failure_an_emergency_save_marks_detection() -> None:
    records, injections = _lost_node_logs()
    records = [r for r in records if r.get("event") != PEER_FAILURE]
    report = build_report(
        records, injections, start_ts=90.0, global_batch_size=32, max_steps=100, planned_faults=1
    )
    stages = recovery_stages(report["faults"][0], records)
    assert stages is not None and stages["detect_s"] == pytest.approx(0.4)


def test_no_stages_without_recovery() -> None:
    records, injections = _lost_node_logs()
    stuck = [r for r in records if r["ts"] <= 100.0]
    report = build_report(
        stuck, injections, start_ts=90.0, global_batch_size=32, max_steps=100, planned_faults=1
    )
    assert recovery_stages(report["faults"][0], stuck) is None


# -- one run's figures ----------------------------------------------------------------------
def _report(status: str, recovered: bool, faults: int = 1) -> dict[str, Any]:
    fault = {
        "recovered": recovered,
        "downtime_s": 6.5 if recovered else None,
        "steps_lost": 0 if recovered else None,
        "last_step_before": 31,
        "world_size_before": 3,
        "world_size_after": 2 if recovered else 3,
        "resume_source": "local" if recovered else None,
        "injected_at": 1.0,
        "recovered_at": 7.5 if recovered else None,
        "resumed_at": None,
    }
    return {"outcome": {"status": status, "message": "why"}, "faults": [fault] * faults}


def test_measure_run_tells_recovery_no_recovery_and_errors_apart() -> None:
    args = {"rep": 0, "kind": "kill", "profile_name": "lab", "cap_s": 60.0}
    ok = measure_run(_report("settled", True), [], **args)
    assert (ok["recovered"], ok["downtime_s"], ok["steps_lost"], ok["error"]) == (
        True,
        6.5,
        0,
        None,
    )
    capped = measure_run(_report("timeout", False), [], **args)
    assert (capped["downtime_s"], capped["no_recovery_within_s"], capped["error"]) == (
        None,
        60.0,
        None,
    )
    failed = measure_run(_report("failed", False), [], **args)
    assert failed["error"] == "not recovered: why" and failed["no_recovery_within_s"] is None
    never = measure_run(_report("timeout", False, faults=0), [], **args)
    assert never["error"].startswith("the fault was never injected")


def _run(kind: str, name: str, downtime: float | None, lost: int | None, stages=None) -> dict:
    return {
        "kind": kind,
        "profile": name,
        "downtime_s": downtime,
        "steps_lost": lost,
        "error": None,
        "stages": stages,
    }


def _stages(total: float) -> dict[str, Any]:
    return {
        "detect_s": 0.1,
        "rendezvous_s": total - 2.2,
        "startup_s": 2.0,
        "first_step_s": 0.1,
        "total_s": total,
        "paused_s": total - 0.1,
        "phases": {"spawn_and_import_s": 0.8, "build_s": 0.9},
    }


def _summary() -> dict[str, Any]:
    runs = [
        _run("kill", "baseline", 46.0, 12),
        _run("kill", "baseline", 48.0, 5),
        _run("kill", "lab", 6.0, 0, _stages(6.0)),
        _run("kill", "lab", 7.0, 0, _stages(7.0)),
        _run("freeze", "baseline", None, None),
        _run("freeze", "lab", 13.0, 0, _stages(13.0)),
        _run("join", "lab", 4.0, 0, _stages(4.0)),
        _run("join", "baseline", 4.5, 7),
    ]
    return summarize_recovery(runs, ("kill", "freeze", "join"), cap_s=60.0)


def test_summary_per_kind_and_profile() -> None:
    summary = _summary()
    kill = summary["kill"]
    assert kill["baseline"]["downtime_s"]["median"] == 47.0
    assert kill["baseline"]["steps_lost"]["max"] == 12
    assert kill["lab"]["stages"]["total_s"] == 6.5
    assert kill["lab"]["paused_s"]["median"] == pytest.approx(6.4)
    assert kill["baseline"]["paused_s"] is None  # no stages measured for it
    assert kill["lab"]["phases"]["build_s"] == 0.9
    assert kill["downtime_ratio"] == {"value": 7.23, "at_least": False}
    assert summary["freeze"]["baseline"]["downtime_s"]["at_least"] is True
    assert summary["freeze"]["baseline"]["steps_lost"] is None
    assert summary["freeze"]["downtime_ratio"] == {"value": 4.62, "at_least": True}


def test_targets_say_met_or_missed_and_why() -> None:
    targets = {t["name"]: t for t in recovery_targets(_summary(), lab_profile())}
    speed = targets["kill: downtime vs torchrun defaults"]
    assert (speed["met"], speed["value"]) == (False, "7.2x")
    assert speed["why"].startswith("6.5 s = detect 0.1 + rendezvous 4.3 + start-up 2.0")
    kill = targets["kill: fault -> first step at the new size (lab, median)"]
    assert (kill["met"], kill["target"], kill["value"]) == (False, "<= 2.5 s", "6.5 s")
    freeze = targets["freeze: fault -> first step at the new size (lab, median)"]
    assert (freeze["met"], freeze["target"]) == (False, "<= 6 s")  # 13 s: the timeout's doing
    assert "freeze: downtime vs torchrun defaults" not in targets  # only kill has a ratio
    assert targets["join: new node -> first step at the larger size (lab, median)"]["met"] is True
    assert targets["kill: steps lost with a survivor (lab)"]["met"] is True
    assert "evict: fault -> first step at the new size (lab, median)" not in targets  # not run


def test_an_etcd_outage_is_met_only_with_no_pause_and_no_restart() -> None:
    def outage(paused: list[float], restarts: list[int]) -> dict[str, Any]:
        runs = [
            {**_run("etcd", "lab", p, 0, {"paused_s": p}), "restarts": r}
            for p, r in zip(paused, restarts, strict=True)
        ]
        summary = summarize_recovery(runs, ("etcd",), cap_s=60.0)
        (target,) = [t for t in recovery_targets(summary, lab_profile()) if "etcd" in t["name"]]
        return target

    assert outage([0.0, 0.0], [0, 0])["met"] is True
    missed = outage([0.0, 12.5], [0, 3])
    assert (missed["met"], missed["value"]) == (False, "max 12.5 s paused, 3 restarts")


def test_steady_target_and_explanation() -> None:
    elastic_cpu = {"worker": 40.0, "agent": 2.0, "etcd": 1.0}
    runs = [
        {"pair": 0, "mode": "elastic", "step_times_s": [0.26, 0.25, 0.27], "steps_run": 100},
        {"pair": 1, "mode": "elastic", "step_times_s": [], "steps_run": 100},
        {"pair": 0, "mode": "static", "step_times_s": [0.25, 0.24, 0.26], "steps_run": 50},
    ]
    runs[0]["cpu_s"], runs[1]["cpu_s"], runs[2]["cpu_s"] = {}, elastic_cpu, {}
    steady = summarize_steady(runs)
    assert steady["median_ratio"] == pytest.approx(0.26 / 0.25, abs=1e-4)
    assert steady["pair_ratios"] == [pytest.approx(0.26 / 0.25, abs=1e-4)]  # pair 1 is empty
    assert steady["pair_ratio_median"] == pytest.approx(1.04, abs=1e-4)
    assert steady["elastic"]["cpu_s_per_step"] == {"agent": 0.01, "etcd": 0.005, "worker": 0.2}
    assert steady["static"]["cpu_s_per_step"] == {}
    target = steady_target(steady)
    assert target["met"] is False and "elastic 0.2600 s vs static 0.2500 s" in target["why"]
    assert target["why"].startswith("pairs 1.040;")


def test_pair_ratios_take_each_pair_on_its_own() -> None:
    # The machine got 20 % slower between the pairs; each pair's ratio does not see it.
    runs = [
        {"pair": 0, "mode": "elastic", "step_times_s": [1.01, 1.01]},
        {"pair": 0, "mode": "static", "step_times_s": [1.0, 1.0]},
        {"pair": 1, "mode": "static", "step_times_s": [1.2, 1.2]},
        {"pair": 1, "mode": "elastic", "step_times_s": [1.212, 1.212]},
    ]
    assert pair_ratios(runs) == [1.01, 1.01]


def test_step_times_skip_warm_up_and_other_world_sizes() -> None:
    records = [
        {**_metrics(1.0, 1, 2), "step_time_s": 0.9},
        {**_metrics(2.0, 2, 1), "step_time_s": 0.5},
        {**_metrics(3.0, 3, 2), "step_time_s": 0.2},
        _record(3.5, "node-0", event=CHECKPOINT_SAVED, step=3),
    ]
    assert step_times(records, world_size=2, warmup_steps=1) == [0.2]


def test_tables_print_no_recovery_as_a_bound() -> None:
    summary = _summary()
    assert format_seconds(summary["freeze"]["baseline"]["downtime_s"]) == (
        ">= 60 s (no recovery x1)"
    )
    table = recovery_table(summary, 10)
    assert ">= 60 s (no recovery x1)" in table and ">=4.6x" in table
    assert "47.0 [46.0-48.0] s" in table
    breakdown = breakdown_table(summary)
    assert "freeze  baseline  >= 60 s (no recovery x1)" in breakdown
    text = targets_table(recovery_targets(summary, lab_profile()))
    assert "MISSED" in text and "why: 6.5 s = detect" in text


def test_explain_lists_the_big_phases_largest_first() -> None:
    text = explain(_stages(6.0), {"spawn_and_import_s": 0.8, "build_s": 0.9, "ddp_s": 0.001})
    assert text == (
        "6.0 s = detect 0.1 + rendezvous 3.8 + start-up 2.0 (build 0.90, spawn and import 0.80)"
        " + first step 0.10"
    )


# -- the command line -----------------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_smoke_preset_and_overrides() -> None:
    smoke = config_from_args(_args("--smoke"))
    assert (smoke.reps, smoke.kinds, smoke.steady_pairs, smoke.smoke) == (1, ("freeze",), 1, True)
    full = config_from_args(_args("--reps", "5", "--kinds", "kill,join", "--recovery-cap-s", "90"))
    assert (full.reps, full.kinds, full.recovery.recovery_cap_s) == (5, ("kill", "join"), 90.0)
    assert config_from_args(_args()).kinds == ("kill", "evict", "freeze", "join", "etcd")
    assert (smoke.chaos_schedules, config_from_args(_args()).chaos_schedules) == (1, 200)
    assert config_from_args(_args("--chaos-schedules", "0")).chaos_schedules == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--kinds", "kill,boom"), "--kinds: boom is not a fault kind; allowed: kill,evict"),
        (("--reps", "0"), "--reps must be >= 1"),
        (("--steady-pairs", "0"), "--steady-pairs must be >= 1"),
        (("--recovery-cap-s", "0"), "recovery_cap_s must be > 0"),
        (("--chaos-schedules", "-1"), "--chaos-schedules must be >= 0"),
    ],
)
def test_bad_flags_are_named(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(_args(*argv))
