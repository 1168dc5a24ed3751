"""Scenarios: built-ins, files, flags, and the errors that name the bad key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lab.local.scenario import (
    FAULT_KINDS,
    Fault,
    Scenario,
    ScenarioError,
    TrainSettings,
    plan_membership,
    validate_scenario,
)
from lab.local.scenario_file import (
    BUILTIN_SCENARIOS,
    load_scenario,
    parse_fault_flag,
    scenario_from_dict,
    with_overrides,
)


def _scenario(**overrides) -> Scenario:
    base = Scenario(name="t", nodes=3, min_nodes=1, max_nodes=3)
    return dataclasses.replace(base, **overrides)


def _data(**top) -> dict:
    return {"nodes": 3, "train": {"max_steps": 100}, **top}


@pytest.mark.parametrize("name", BUILTIN_SCENARIOS)
def test_builtin_scenarios_cover_every_fault_kind(name: str) -> None:
    scenario = load_scenario(name)
    assert {f.kind for f in scenario.faults} == set(FAULT_KINDS)
    assert validate_scenario(scenario)[-1].world_size >= scenario.min_nodes


def test_ci_is_shorter_than_default() -> None:
    ci, default = load_scenario("ci"), load_scenario("default")
    assert ci.train.max_steps * ci.train.global_batch_size < (
        default.train.max_steps * default.train.global_batch_size
    )


def test_membership_plan_gives_new_nodes_new_numbers() -> None:
    scenario = _scenario(
        faults=(
            Fault("evict", node=2, at_step=10),
            Fault("join", at_step=20),
            Fault("kill-all", nodes=2, at_step=30),
        )
    )
    evict, join, kill_all = plan_membership(scenario)
    assert (evict.stopped, evict.started, evict.world_size) == ((2,), (), 2)
    assert (join.stopped, join.started, join.world_size) == ((), (3,), 3)
    assert (kill_all.stopped, kill_all.started, kill_all.world_size) == ((0, 1, 3), (4, 5), 2)


def test_unknown_fault_kind_lists_the_allowed_kinds() -> None:
    with pytest.raises(
        ScenarioError,
        match=r"faults\[0\]\.kind: unknown fault kind 'explode'.*"
        r"allowed: kill, evict, freeze, join, etcd-restart, kill-all",
    ):
        validate_scenario(_scenario(faults=(Fault("explode", at_step=5),)))


def test_a_node_that_does_not_exist_is_named() -> None:
    with pytest.raises(
        ScenarioError, match=r"faults\[0\]\.node: cannot kill node 7.*running nodes: 0, 1, 2"
    ):
        validate_scenario(_scenario(faults=(Fault("kill", node=7, at_step=5),)))


def test_a_node_that_is_already_gone_is_rejected() -> None:
    faults = (Fault("kill", node=1, at_step=5), Fault("freeze", node=1, at_step=6))
    with pytest.raises(
        ScenarioError, match=r"faults\[1\]\.node: cannot freeze node 1.*running nodes: 0, 2"
    ):
        validate_scenario(_scenario(faults=faults))


@pytest.mark.parametrize("step", [0, 300, 301])
def test_step_out_of_range_names_the_range(step: int) -> None:
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.at_step: .*allowed: 1\.\.299"):
        validate_scenario(_scenario(faults=(Fault("join", at_step=step),)))


def test_exactly_one_trigger() -> None:
    with pytest.raises(ScenarioError, match="exactly one of at_step and at_time"):
        validate_scenario(_scenario(faults=(Fault("etcd-restart"),)))
    with pytest.raises(ScenarioError, match="exactly one of at_step and at_time"):
        validate_scenario(_scenario(faults=(Fault("etcd-restart", at_step=3, at_time=1.0),)))


def test_faults_must_not_go_back_in_steps() -> None:
    faults = (Fault("etcd-restart", at_step=50), Fault("etcd-restart", at_step=10))
    with pytest.raises(ScenarioError, match="must not decrease"):
        validate_scenario(_scenario(faults=faults))


def test_join_beyond_max_nodes_is_rejected() -> None:
    with pytest.raises(ScenarioError, match=r"faults\[0\].*max_nodes is 3"):
        validate_scenario(_scenario(faults=(Fault("join", at_step=5),)))


def test_losing_below_min_nodes_is_rejected() -> None:
    scenario = _scenario(nodes=2, min_nodes=2, faults=(Fault("kill", node=0, at_step=5),))
    with pytest.raises(ScenarioError, match="below min_nodes 2"):
        validate_scenario(scenario)


def test_node_is_only_for_node_faults() -> None:
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.node: required for kill, evict, freeze"):
        validate_scenario(_scenario(faults=(Fault("join", node=1, at_step=5),)))


def test_unknown_restart_policy_lists_allowed() -> None:
    with pytest.raises(ScenarioError, match="restart_policy: 'Always'; allowed: OnFailure, Never"):
        validate_scenario(_scenario(restart_policy="Always"))


def test_unknown_key_lists_the_allowed_keys() -> None:
    data = _data(faults=[{"kind": "kill", "node": 0, "at_step": 5, "grace": 3}])
    with pytest.raises(
        ScenarioError, match=r"faults\[0\]: unknown key\(s\) grace; allowed: .*grace_s"
    ):
        scenario_from_dict(data, "x")
    with pytest.raises(ScenarioError, match=r"train: unknown key\(s\) steps"):
        scenario_from_dict({"train": {"steps": 5}}, "x")
    with pytest.raises(ScenarioError, match=r"^scenario: unknown key\(s\) node_count"):
        scenario_from_dict({"node_count": 5}, "x")


def test_wrong_types_name_the_key() -> None:
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.at_step: expected int, got 'soon'"):
        scenario_from_dict(_data(faults=[{"kind": "join", "at_step": "soon"}]), "x")
    with pytest.raises(ScenarioError, match=r"train\.max_steps: expected int, got 2.5"):
        scenario_from_dict({"train": {"max_steps": 2.5}}, "x")


def test_toml_and_json_files_load_the_same(tmp_path: Path) -> None:
    toml = tmp_path / "mine.toml"
    toml.write_text(
        'nodes = 2\n[train]\nmax_steps = 50\n[[faults]]\nkind = "kill"\nnode = 1\nat_step = 10\n'
    )
    json_file = tmp_path / "mine.json"
    json_file.write_text(
        json.dumps(
            {
                "nodes": 2,
                "train": {"max_steps": 50},
                "faults": [{"kind": "kill", "node": 1, "at_step": 10}],
            }
        )
    )
    from_toml, from_json = load_scenario(str(toml)), load_scenario(str(json_file))
    assert from_toml == from_json
    assert from_toml.name == "mine"
    assert from_toml.faults == (Fault("kill", node=1, at_step=10),)


def test_missing_scenario_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(
        ScenarioError, match=r"--scenario: .*neither a built-in scenario \(default, ci, charlm\)"
    ):
        load_scenario(str(tmp_path / "nope.toml"))


def test_fault_flag_uses_the_file_keys() -> None:
    assert parse_fault_flag("kind=kill, node=1,at_step=40") == {
        "kind": "kill",
        "node": "1",
        "at_step": "40",
    }
    with pytest.raises(ScenarioError, match="--fault: expected key=value"):
        parse_fault_flag("kill@40")


def test_overrides_replace_faults_and_are_validated() -> None:
    scenario = with_overrides(
        load_scenario("ci"),
        nodes=2,
        max_steps=80,
        fault_flags=[
            "kind=evict,node=1,at_step=10,grace_s=3",
            "kind=etcd-restart,at_time=5,wipe_data=true",
        ],
    )
    assert scenario.nodes == 2 and scenario.train.max_steps == 80
    assert scenario.faults == (
        Fault("evict", node=1, at_step=10, grace_s=3.0),
        Fault("etcd-restart", at_time=5.0, wipe_data=True),
    )
    with pytest.raises(
        ScenarioError, match=r"--fault\[0\]\.kind: .*'boom'|unknown fault kind 'boom'"
    ):
        with_overrides(load_scenario("ci"), fault_flags=["kind=boom,at_step=3"])


def test_train_args_are_the_training_programs_flags() -> None:
    args = load_scenario("ci").train.args("/data")
    assert "--data-dir=/data" in args
    assert "--log-every=1" in args
    assert all(a.startswith("--") and "=" in a for a in args)


def test_the_charlm_scenario_runs_the_task_with_its_own_options_and_evaluations() -> None:
    train = load_scenario("charlm").train
    args = train.args("/data")
    assert "--task=charlm" in args and "--n-layer=2" in args and "--eval-every=25" in args
    assert not [a for a in args if a.startswith("--model-width")]  # cifar's, not the LM's
    assert "--task=cifar" in load_scenario("ci").train.args("/data")


@pytest.mark.parametrize(
    ("train", "message"),
    [
        (
            {"task": "charlm", "task_options": "--model-width=4"},
            r"^train\.task_options: '--model-width=4' holds a flag the charlm task does not have",
        ),
        ({"task": "charlm", "task_options": "--n-embd=30"}, r"--n-embd \(30\) must be a multiple"),
        ({"task": "gpt"}, r"^train\.task: \(or TRAIN_TASK\) must be one of charlm, cifar"),
        ({"eval_every": -1}, r"^train\.eval_every: must be >= 0"),
    ],
)
def test_a_tasks_settings_are_checked_up_front(train: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        validate_scenario(_scenario(train=TrainSettings(**train)))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"nodes": [1]}, r"^nodes: expected int, got \[1\] \(allowed: an integer\)"),
        ({"timeout_s": {"a": 1}}, r"^timeout_s: expected float, got \{'a': 1\}"),
        ({"timeout_s": float("inf")}, r"^timeout_s: expected float, got inf"),
        ({"nodes": True}, r"^nodes: expected int, got True"),
        ({"name": 5}, r"^name: expected str, got 5 \(allowed: a string\)"),
        ({"train": {"lr": [0.1]}}, r"^train\.lr: expected float, got \[0\.1\]"),
        ({"train": [1]}, r"^train: expected a table, got list"),
        ({"stop_when_settled": "maybe"}, r"stop_when_settled: expected bool.*true or false"),
        (
            {"faults": [{"node": 1, "at_step": 3}]},
            r"^faults\[0\]\.kind: required; allowed: kill, evict, freeze, join",
        ),
        ({"faults": [{"kind": "kill", "node": [1], "at_step": 3}]}, r"faults\[0\]\.node: exp"),
        ({"faults": [{"kind": "kill", "node": 1, "at_step": 1e400}]}, r"at_step: expected int"),
        ({"rendezvous": {"last_call_timeout_s": 0}}, r"^rendezvous\.last_call_timeout_s: must"),
    ],
)
def test_a_bad_value_of_any_type_names_the_key_and_what_is_allowed(
    data: dict, message: str
) -> None:
    with pytest.raises(ScenarioError, match=message):
        scenario_from_dict(data, "x")


def test_a_scenario_that_is_not_a_table_is_an_error() -> None:
    with pytest.raises(ScenarioError, match="scenario: expected a table of keys, got list"):
        scenario_from_dict([1, 2], "x")  # type: ignore[arg-type]


def test_a_file_that_is_not_text_names_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b"\xff\xfe\x00nodes")
    with pytest.raises(ScenarioError, match=r"--scenario: .*bad\.toml does not parse"):
        load_scenario(str(path))


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"lr": 0.0}, r"^train\.lr: must be > 0, got 0\.0"),
        ({"checkpoint_keep": 0}, r"^train\.checkpoint_keep: must be >= 1, got 0"),
        ({"seed": -1}, r"^train\.seed: must be >= 0, got -1"),
        ({"checkpoint_every_steps": -5}, r"^train\.checkpoint_every_steps: must be >= 0"),
        ({"checkpoint_every_seconds": -1}, r"^train\.checkpoint_every_seconds: must be >= 0"),
        ({"micro_batch_size": 0}, r"^train\.micro_batch_size: must be >= 1"),
        ({"collective_timeout_s": 0}, r"^train\.collective_timeout_s: must be >= 1"),
    ],
)
def test_training_values_the_training_program_rejects_are_refused_up_front(
    train: dict, message: str
) -> None:
    with pytest.raises(ScenarioError, match=message):
        validate_scenario(_scenario(train=TrainSettings(**train)))


def test_too_few_train_records_says_what_is_allowed() -> None:
    with pytest.raises(
        ScenarioError, match=r"train\.train_records: 16 is too small; allowed: >= 32 \(one global"
    ):
        validate_scenario(_scenario(train=TrainSettings(train_records=16)))
    with pytest.raises(ScenarioError, match=r"train_records: 4 is too small; allowed: >= 5"):
        validate_scenario(
            _scenario(train=TrainSettings(train_records=4, global_batch_size=2, micro_batch_size=1))
        )


def test_kill_all_may_not_start_more_than_max_nodes() -> None:
    faults = (Fault("kill-all", nodes=4, at_step=5),)
    with pytest.raises(
        ScenarioError,
        match=r"faults\[0\]\.nodes: kill-all starts 4 new node\(s\), more than "
        r"max_nodes 3; allowed: 1\.\.3",
    ):
        validate_scenario(_scenario(faults=faults))
    validate_scenario(_scenario(faults=(Fault("kill-all", nodes=3, at_step=5),)))


def test_nodes_is_only_for_kill_all() -> None:
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.nodes: only allowed for kill-all"):
        validate_scenario(_scenario(faults=(Fault("join", nodes=2, at_step=5),)))


def test_at_time_must_come_before_the_timeout() -> None:
    with pytest.raises(
        ScenarioError,
        match=r"faults\[0\]\.at_time: 600 is out of range; allowed: 0 <= at_time < "
        r"timeout_s \(600\)",
    ):
        validate_scenario(_scenario(faults=(Fault("join", at_time=600.0),)))
    validate_scenario(_scenario(nodes=2, faults=(Fault("join", at_time=599.0),)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_steps": 0}, r"^--max-steps: must be >= 1, got 0"),
        ({"max_steps": 10}, r"at_step: 20 is out of range; allowed: 1\.\.9 \(--max-steps is 10\)"),
        ({"nodes": 0}, r"^--nodes: 0 must be within min_nodes\.\.max_nodes"),
        ({"fault_flags": ["node=1,at_step=3"]}, r"^--fault\[0\]\.kind: required; allowed: kill"),
        ({"fault_flags": ["kind=kill,node=9,at_step=3"]}, r"^--fault\[0\]\.node: cannot kill"),
    ],
)
def test_an_error_about_an_overridden_value_names_its_flag(overrides: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        with_overrides(load_scenario("ci"), **overrides)
