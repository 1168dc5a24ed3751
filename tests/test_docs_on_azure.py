"""docs/your-model-on-azure.md, run: every command of its shell blocks in order, the Pulumi ones
under the program's mocks with the state one `up` leaves for the next, the lab's through its
own argument parser, and the lines it quotes from `pulumi up` as the program says them."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.cli import build_parser
from tests.support.pulumi_harness import PROJECT_DIR, AzureAnswers, ProgramRun, run_program
from tests.support.user_package import write_user_package

PAGE = PROJECT_DIR / "docs" / "your-model-on-azure.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(), re.M | re.S)


def _commands() -> list[str]:
    lines = (line.strip() for block in _blocks("sh") for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


class Deployment:
    """The stack's config as `pulumi config set` leaves it, and what each `up` left."""

    def __init__(self, home: Path) -> None:
        self.home = home
        stack_file = yaml.safe_load((PROJECT_DIR / "Pulumi.dev.yaml").read_text())["config"]
        # `--path` sets one key of the object the stack file already holds.
        self.config: dict[str, Any] = {"trainArgs": dict(stack_file["spot-lab:trainArgs"])}
        self.run: ProgramRun | None = None

    def set(self, args: list[str]) -> None:
        path = args[0] == "--path"
        key, value = args[1:] if path else args
        value = value.replace("~", str(self.home))
        if path:  # the CLI stores the value as a string
            top, _, leaf = key.partition(".")
            self.config.setdefault(top, {})[leaf] = value
        else:
            self.config[key] = value

    def up(self) -> ProgramRun:
        records = {}
        if self.run is not None:
            for record in self.run.of_type("kubernetes:core/v1:ConfigMap"):
                records[record.name] = {"data": record.inputs["data"]}
        overrides = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in self.config.items()}
        run = run_program(
            "dev", overrides, check=False, fresh=True, answers=AzureAnswers(kept_inputs=records)
        )
        assert run.error is None, run.error
        self.run = run
        return run

    def output(self, name: str) -> Any:
        assert self.run is not None and name in self.run.outputs, name
        return self.run.outputs[name]


def _lab(argv: list[str]) -> None:
    """The lab's own parser takes the page's arguments (nothing runs: each command's behaviour
    has its own tests)."""
    build_parser().parse_args(argv)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    package = write_user_package(tmp_path / "written")
    shutil.copytree(package, tmp_path / "my-repo")
    (tmp_path / "my-repo" / "train_ddp.py").write_text("import torch.distributed\n")
    (tmp_path / "points").mkdir()
    return tmp_path


def _substituted(line: str, stack: Deployment) -> str:
    return re.sub(
        r'"\$\(pulumi stack output (\w+)\)"', lambda m: shlex.quote(stack.output(m[1])), line
    )


def _walk(stack: Deployment) -> Iterator[tuple[str, list[str]]]:
    for line in _commands():
        yield line, shlex.split(_substituted(line, stack).split(" > ")[0])


def test_the_walk_through_runs(home: Path) -> None:
    stack, destroyed = Deployment(home), 0
    for line, argv in _walk(stack):
        if argv[:3] == ["pulumi", "config", "set"]:
            stack.set(argv[3:])
        elif argv[:2] in (["pulumi", "up"], ["pulumi", "preview"]):
            stack.up()
        elif argv[:3] == ["pulumi", "stack", "output"]:
            assert stack.run is not None and "--show-secrets" in argv
            (home / "outputs.json").write_text(json.dumps(stack.run.outputs))
        elif argv[:2] == ["pulumi", "destroy"]:
            run = stack.up()
            kept = {r.name for r in run.resources if r.retain_on_delete}
            retained = stack.config.get("retainCheckpoints", "true") == "true"
            assert bool(kept) == retained and ("keptOnDestroy" in run.outputs) == retained
            destroyed += 1
        elif argv[:3] == ["az", "group", "delete"]:
            group = argv[argv.index("--name") + 1]
            assert group == stack.output("resourceGroup")
            assert f"az group delete --name {group} --yes" in stack.output("keptOnDestroy")
        elif argv[:3] == ["python", "-m", "lab"]:
            _lab(argv[3:])
        else:
            pytest.fail(f"the page has a command no test runs: {line}")
    assert destroyed == 2 and stack.run is not None
    command = stack.run.one("kubernetes:kubeflow.org/v1:PyTorchJob").inputs["spec"]
    (container,) = command["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["command"][3:5] == ["train_ddp.py", "--epochs=10"]


def test_the_stack_file_snippet_is_a_stack_file_the_program_takes(home: Path) -> None:
    (snippet,) = _blocks("yaml")
    values = yaml.safe_load(snippet)["config"]
    overrides = {k.split(":", 1)[1]: json.dumps(v) for k, v in values.items()}
    overrides |= {
        "taskPackage": str(home / "my-repo"),
        "task": "mytask.model:spec",
        "dataSourceUrl": "none",
    }
    run = run_program("dev", overrides, fresh=True)
    (container,) = run.one("kubernetes:kubeflow.org/v1:PyTorchJob").inputs["spec"][
        "pytorchReplicaSpecs"
    ]["Worker"]["template"]["spec"]["containers"]
    assert container["command"][-3:] == ["--lr=0.0004", "--micro-batch-size=32", "--width=128"]


def _said(home: Path, config: dict[str, Any], records: ProgramRun | None = None) -> str:
    base = {
        "trainArgs": {},
        "taskPackage": str(home / "my-repo"),
        "task": "mytask.model:spec",
        "dataSourceUrl": "none",
    }
    overrides = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in (base | config).items()}
    kept = {}
    if records is not None:
        record = records.one("kubernetes:core/v1:ConfigMap")
        kept = {record.name: {"data": record.inputs["data"]}}
    run = run_program(
        "dev", overrides, check=False, fresh=True, answers=AzureAnswers(kept_inputs=kept)
    )
    (problem,) = run.error.problems  # type: ignore[union-attr]
    return problem.replace(str(home / "my-repo"), "/home/ada/my-repo")


def test_the_lines_the_page_quotes_are_the_programs(home: Path) -> None:
    quoted = [line for block in _blocks("text") for line in block.splitlines()]
    quoted = [line for line in quoted if line.startswith("spot-lab:")]
    model = home / "my-repo" / "mytask" / "model.py"
    started = run_program(
        "dev",
        {
            "taskPackage": str(home / "my-repo"),
            "task": "mytask.model:spec",
            "dataSourceUrl": "none",
            "trainArgs": json.dumps({"width": 128}),
        },
        fresh=True,
    )
    said = [
        _said(home, {"task": "mytask.nothere:spec"}),
        _said(home, {"trainArgs": {"widht": 1}}),
        _said(home, {"trainArgs": {"max-steps": 1}}),
        _said(home, {"trainArgs": {"width": 256}}, started),
    ]
    model.write_text(model.read_text().replace("validation: int = 16", "lr: float = 0.1"))
    said.append(_said(home, {}))
    for line in quoted:
        head = line.removesuffix(" ...")
        assert any(s == line or (line.endswith("...") and s.startswith(head)) for s in said), line
