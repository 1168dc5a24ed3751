"""stack_config.train_args and task_package: trainArgs against the loop and the task, the run's
identity, and what the package would put in the image. Pure but for the package's files."""

from __future__ import annotations

import json
import os
from dataclasses import fields, replace
from pathlib import Path

import pytest

from stack_config import ConfigError, LabConfig, load, validate
from stack_config.task_package import resolve
from stack_config.train_args import LOOP_FLAGS, OWNED, identity_problem, script_flags
from tests.support.user_package import write_user_package
from training.loop.settings import CheckpointConfig, DataConfig, OptimConfig, RunConfig

PROJECT_DIR = Path(__file__).resolve().parents[2]


def _resolved(raw: dict[str, object], package: Path | None = None) -> LabConfig:
    strings = {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in raw.items()}
    if package is not None:
        strings |= {"taskPackage": str(package), "dataSourceUrl": "none"}
        strings.setdefault("task", "mytask.model:spec")
    cfg = load(strings, "spot-lab", "dev")
    validate(cfg)
    return resolve(cfg, PROJECT_DIR)[0]


def _problems(raw: dict[str, object], package: Path | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _resolved(raw, package)
    return info.value.problems


@pytest.fixture
def package(tmp_path: Path) -> Path:
    return write_user_package(tmp_path)


def test_the_loop_flags_are_the_training_configs_fields() -> None:
    sections = (DataConfig, OptimConfig, CheckpointConfig, RunConfig)
    assert set(LOOP_FLAGS) == {f.name for s in sections for f in fields(s)}
    assert set(OWNED) <= set(LOOP_FLAGS)


def test_loop_flags_and_task_options_become_typed_flags(package: Path) -> None:
    cfg = _resolved(
        {
            "trainArgs": {
                "lr": "0.0004",  # `pulumi config set --path` stores a string
                "micro-batch-size": 16,
                "compile": True,
                "eval_every": 50,
                "init-from": "https://acct.blob.core.windows.net/checkpoints/base",
                "width": 32,
            }
        },
        package,
    )
    assert cfg.training.flags == (
        "--compile=true",
        "--eval-every=50",
        "--init-from=https://acct.blob.core.windows.net/checkpoints/base",
        "--lr=0.0004",
        "--micro-batch-size=16",
        "--width=32",
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"lr": "fast"}, "spot-lab:trainArgs.lr must be a number, got 'fast'"),
        ({"micro-batch-size": 1.5}, "spot-lab:trainArgs.micro-batch-size must be an integer"),
        ({"compile": "yes"}, "spot-lab:trainArgs.compile must be true or false"),
        ({"width": True}, "spot-lab:trainArgs.width must be an integer"),
        (
            {"widht": 32},
            "spot-lab:trainArgs.widht is neither a flag of the training loop nor an option of "
            "spot-lab:task mytask.model:spec (did you mean width?); the task's options: width, "
            "validation;",
        ),
        (
            {"max-steps": 10},
            "spot-lab:trainArgs.max-steps sets --max-steps, which the stack key spot-lab:maxSteps "
            "sets too: set it there only",
        ),
        (
            {"global_batch_size": 64},
            "which the stack key spot-lab:globalBatchSize sets too",
        ),
        (
            {"checkpoint-uri": "/tmp/x"},
            "spot-lab:trainArgs.checkpoint-uri sets --checkpoint-uri, which the job sets itself",
        ),
        ({"lr": 0.1, "--lr": 0.2}, "sets --lr a second time"),
        ({"lr=": 0.1}, "a flag name is letters, digits, '-' or '_'"),
    ],
)
def test_a_bad_train_arg_is_one_line_naming_it(
    package: Path, args: dict[str, object], expected: str
) -> None:
    (problem,) = _problems({"trainArgs": args}, package)
    assert expected in problem and "\n" not in problem


def test_a_built_in_tasks_options_are_known_too() -> None:
    cfg = _resolved({"trainArgs": {"model-width": 32, "dropout": 0.1}})
    assert cfg.training.flags == ("--dropout=0.1", "--model-width=32")
    (problem,) = _problems({"trainArgs": {"n-layer": 2}})  # charlm's, not cifar's
    assert "spot-lab:trainArgs.n-layer is neither" in problem


def test_a_task_option_named_like_a_loop_flag_is_refused_naming_it(package: Path) -> None:
    model = package / "mytask" / "model.py"
    text = model.read_text().replace("    validation: int = 16", "    lr: float = 0.1")
    model.write_text(text)
    (problem,) = _problems({}, package)
    assert problem.startswith(
        "spot-lab:task mytask.model:spec: its option lr (model.py) has the name of the training "
        "loop's --lr; rename the option"
    )


def test_a_missing_module_names_task_and_task_package(package: Path) -> None:
    (problem,) = _problems({"task": "mytask.nothere:spec"}, package)
    assert problem == (
        f"spot-lab:task mytask.nothere:spec cannot be imported from spot-lab:taskPackage "
        f"{package}: no module mytask.nothere (looked for mytask/nothere.py or "
        "mytask/nothere/__init__.py)"
    )
    (problem,) = _problems({"task": "mytask.model:other"}, package)
    assert "module mytask.model has no attribute other" in problem


def test_an_opaque_task_leaves_its_options_to_the_workers_and_says_so(package: Path) -> None:
    model = package / "mytask" / "model.py"
    model.write_text(model.read_text() + "\nspec = build_spec()\n")
    cfg = load(
        {
            "task": "mytask.model:spec",
            "taskPackage": str(package),
            "dataSourceUrl": "none",
            "trainArgs": json.dumps({"anything": 1}),
        },
        "spot-lab",
        "dev",
    )
    cfg, warnings = resolve(cfg, PROJECT_DIR)
    assert cfg.training.flags == ("--anything=1",)
    assert "the workers check spot-lab:trainArgs when they start" in warnings[0]


def test_what_the_image_build_must_not_send_is_refused_with_the_fix(package: Path) -> None:
    (package / ".dockerignore").write_text("data\n")
    (package / ".git").mkdir()
    (package / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (package / "env").mkdir()
    (package / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (package / "training").mkdir()
    (package / "training" / "__init__.py").write_text("")
    git, venv, clash = _problems({}, package)
    assert "would send .git" in git and f"add the line .git to {package / '.dockerignore'}" in git
    assert "would send the virtualenv env" in venv
    assert "holds training at its top: it would replace the lab's own training package" in clash


def test_loose_requirements_are_built_but_said(package: Path) -> None:
    (package / "requirements.txt").write_text("tomli==2.2.1\neinops\n# a comment\n-r more.txt\n")
    cfg = load(
        {"task": "mytask.model:spec", "taskPackage": str(package), "dataSourceUrl": "none"},
        "spot-lab",
        "dev",
    )
    (warning,) = resolve(cfg, PROJECT_DIR)[1]
    assert warning.endswith(
        "einops has no exact version (==): a new image may install another version"
    )


def test_a_relative_task_package_starts_at_the_project(package: Path) -> None:
    cfg = _resolved({"taskPackage": os.path.relpath(package, PROJECT_DIR)})
    assert cfg.training.package_dir == str(package.resolve())


def test_a_script_takes_train_args_as_its_own_arguments(package: Path) -> None:
    (package / "train_ddp.py").write_text("print('hello')\n")
    cfg = _resolved(
        {
            "launcher": "torchrun",
            "script": "train_ddp.py",
            "trainArgs": {"epochs": 3, "use_amp": True, "resume": False, "lr": 0.1},
        },
        package,
    )
    assert cfg.training.flags == ("--epochs=3", "--lr=0.1", "--use_amp")
    assert cfg.training.identity == {"script": "train_ddp.py"} and cfg.training.lineage
    loop = _resolved({}, package)
    problem = identity_problem(replace(cfg, job=replace(cfg.job, run_id="1")), _recorded(loop))
    assert problem == (
        "spot-lab:script: run 1 ran the lab's training loop, the stack now runs script "
        "train_ddp.py; another program is another run: set spot-lab:runId to a new value"
    )
    assert script_flags({"--x": "a b"}) == ("--x=a b",)
    (problem,) = _problems({"launcher": "torchrun", "script": "absent.py"}, package)
    assert problem == f"spot-lab:script absent.py: no such file in spot-lab:taskPackage {package}"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"script": "x.py", "taskPackage": "p"}, "spot-lab:script runs under plain torchrun"),
        ({"script": "x.py", "launcher": "torchrun"}, "spot-lab:script is a path in"),
        (
            {"script": "../x.py", "launcher": "torchrun", "taskPackage": "p"},
            "must be a .py file's path inside spot-lab:taskPackage (relative, no '..')",
        ),
        ({"launcher": "cold"}, "spot-lab:launcher must be one of warm, torchrun; got 'cold'"),
        ({"dataPrefix": "a/../b", "dataSourceUrl": "none"}, "spot-lab:dataPrefix must be a folder"),
        ({"dataPrefix": "points/v2"}, "staging writes the container's top"),
        ({"retainCheckpoints": "maybe"}, "spot-lab:retainCheckpoints must be true or false"),
        ({"trainArgs": "[1, 2]"}, "spot-lab:trainArgs must be a map of flag names to values"),
        ({"trainArgs": '{"lr": {"a": 1}}'}, "spot-lab:trainArgs.lr must be one value"),
    ],
)
def test_the_configs_own_rules(raw: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(load(raw, "spot-lab", "dev"))
    assert expected in str(info.value)


# ---- the run's identity ------------------------------------------------------------------------


def test_the_built_in_tasks_at_their_default_shape_keep_the_jobs_folder() -> None:
    cfg = _resolved({"trainArgs": {"lr": 0.1, "model-width": 16}})
    assert cfg.training.lineage == ""
    assert cfg.training.identity["option.model_width"] == 16
    shaped = _resolved({"trainArgs": {"model-width": 32}})
    seeded = _resolved({"trainArgs": {"seed": 7}})
    assert len({shaped.training.lineage, seeded.training.lineage, ""}) == 3


def test_the_identity_follows_what_shapes_the_state_and_not_the_rest(package: Path) -> None:
    base = _resolved({"trainArgs": {"lr": 0.1}}, package)
    assert base.training.identity == {
        "task": "mytask.model:spec",
        "global_batch_size": 256,
        "precision": "fp32",
        "seed": 0,
        "dtype": "float32",
        "option.width": 8,
    }
    resumable = _resolved({"trainArgs": {"lr": 0.01, "validation": 32}}, package)
    assert resumable.training.lineage == base.training.lineage != ""
    wider = _resolved({"trainArgs": {"width": 64}}, package)
    assert wider.training.lineage != base.training.lineage


def _recorded(cfg: LabConfig) -> dict[str, str]:
    training = cfg.training
    return {
        "runId": cfg.job.run_id,
        "identity": json.dumps(dict(training.identity), sort_keys=True),
        "lineage": training.lineage,
    }


def test_a_shape_change_under_the_same_run_id_is_refused_naming_the_setting(
    package: Path,
) -> None:
    started = _resolved({"trainArgs": {"width": 32}}, package)
    wider = _resolved({"trainArgs": {"width": 64}}, package)
    problem = identity_problem(wider, _recorded(started))
    assert problem is not None and "\n" not in problem
    assert problem.startswith(
        "spot-lab:trainArgs.width was 32, now 64: that shapes what run 1's checkpoints hold, so "
        "run 1 cannot resume with it; set spot-lab:runId to a new value"
    )
    new_run = replace(wider, job=replace(wider.job, run_id="2"))
    assert identity_problem(new_run, _recorded(started)) is None
    resumable = _resolved({"trainArgs": {"width": 32, "lr": 0.001}}, package)
    assert identity_problem(resumable, _recorded(started)) is None


def test_the_built_in_tasks_shared_folder_is_left_to_the_workers() -> None:
    started = _resolved({})
    bigger = _resolved({"globalBatchSize": 512})
    assert identity_problem(bigger, _recorded(started)) is None
    wider = _resolved({"trainArgs": {"model-width": 32}})
    assert "spot-lab:trainArgs.model-width was 16, now 32" in identity_problem(
        wider, _recorded(started)
    )
