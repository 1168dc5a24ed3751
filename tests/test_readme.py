"""README.md, checked: every command of its shell blocks is one a test runs or parses (a make
target of the Makefile with its variables' allowed values, the lab's own argument parser, the
Pulumi walk under the program's mocks), its model block trains as its command says, and every
relative link of it and of the docs lands on a file and a heading."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lab.cli import build_parser
from tests.support.markdown import anchors, broken_links, fenced_blocks, shell_commands
from tests.support.pulumi_harness import PROJECT_DIR, run_program

README = PROJECT_DIR / "README.md"
TEXT = README.read_text()
COMMANDS = [c for block in fenced_blocks(TEXT, "sh") for c in shell_commands(block)]
TRAIN = "python -m training.train"
LAB = ".venv/bin/python -m lab "


def _makefile() -> tuple[set[str], dict[str, set[str] | None]]:
    """The Makefile's targets, and its variables with their allowed values when it checks them
    (``$(filter $(VAR),a b)``), else None."""
    text = (PROJECT_DIR / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", text, re.M))
    variables: dict[str, set[str] | None] = {
        name: None for name in re.findall(r"^(\w+) \?=", text, re.M)
    }
    for name, values in re.findall(r"\$\(filter \$\((\w+)\),([^)]*)\)", text):
        variables[name] = set(values.split())
    return targets, variables


def _check_make(argv: list[str]) -> None:
    targets, variables = _makefile()
    for word in argv[1:]:
        name, is_var, value = word.partition("=")
        if not is_var:
            assert name in targets, f"make {name}: no such target in the Makefile"
            continue
        assert name in variables, f"make {word}: the Makefile has no variable {name}"
        allowed = variables[name]
        assert allowed is None or value in allowed, f"make {word}: allowed {sorted(allowed)}"


def _parse_lab(argv: list[str]) -> None:
    """The lab's own parser of the command takes its flags (exit 2 if not): `preflight` and
    `prices` parse their own, as `lab.cli.main` hands them on; nothing runs (each command's
    behaviour has its own tests)."""
    if argv[:1] == ["preflight"]:
        from lab.azure.preflight.flags import build_parser as preflight_parser

        preflight_parser().parse_args(argv[1:])
    elif argv[:1] == ["prices"]:
        from lab.azure.prices.command import build_parser as prices_parser

        prices_parser().parse_args(argv[1:])
    else:
        build_parser().parse_args(argv)


def test_every_command_of_the_readme_is_one_a_test_runs() -> None:
    """Each command falls in a kind this module runs or parses; the kinds are all there."""
    kinds = []
    for command in COMMANDS:
        argv = shlex.split(command.split(" > ")[0])
        if argv[0] == "make":
            _check_make(argv)
            kinds.append("make")
        elif command.startswith(LAB):
            _parse_lab(argv[3:])
            kinds.append("lab")
        elif TRAIN in command:
            kinds.append("train")  # run by test_the_readmes_model_trains_as_its_command_says
        elif argv[0] == "pulumi":
            kinds.append("pulumi")  # run by test_the_readmes_azure_commands_run_under_mocks
        else:
            pytest.fail(f"README has a command no test runs: {command}")
    assert {"make", "lab", "train", "pulumi"} <= set(kinds)
    assert kinds.count("train") == 1


def test_the_readmes_azure_commands_run_under_mocks(tmp_path: Path) -> None:
    """The Pulumi commands in order: the stack's file, each key it sets declared, `up` through
    the whole program, its outputs where the lab's commands read them, `destroy` keeping the
    checkpoints as the page says."""
    config: dict[str, str] = {}
    stack, run = "", None
    for command in COMMANDS:
        argv = shlex.split(command.split(" > ")[0])
        if argv[0] != "pulumi":
            continue
        if argv[1:3] == ["stack", "init"]:
            stack = argv[3]
            assert (PROJECT_DIR / f"Pulumi.{stack}.yaml").exists()
        elif argv[1:3] == ["config", "set"]:
            key, value = argv[3:5]
            config[key] = value
        elif argv[1] == "up":
            run = run_program(stack, config, check=False, fresh=True)
            assert run.error is None, run.error
        elif argv[1:3] == ["stack", "output"]:
            assert run is not None and {"--json", "--show-secrets"} <= set(argv)
            (tmp_path / "outputs.json").write_text(json.dumps(run.outputs))
        elif argv[1] == "destroy":
            assert run is not None and "keptOnDestroy" in run.outputs  # retainCheckpoints
        else:
            pytest.fail(f"README has a pulumi command no test runs: {command}")
    assert run is not None and (tmp_path / "outputs.json").exists()


def test_the_idle_cost_the_readme_says_is_the_one_docs_azure_computes() -> None:
    (said,) = re.findall(r"about \$(\d+) a month", TEXT)
    azure = (PROJECT_DIR / "docs" / "azure.md").read_text()
    (total,) = re.findall(r"^  total +\$([\d.]+)$", azure, re.M)
    assert said == str(round(float(total)))


def test_the_readmes_model_trains_as_its_command_says(tmp_path: Path, processes: None) -> None:
    """The model block, saved where its first line says, trained by the page's own command in a
    directory holding it, "." being this repository."""
    (block,) = fenced_blocks(TEXT, "python")
    where = block.splitlines()[0].removeprefix("# ")
    module = tmp_path / where
    module.parent.mkdir(parents=True)
    (module.parent / "__init__.py").write_text("")
    module.write_text(block)
    (command,) = [c for c in COMMANDS if TRAIN in c]
    env_part, _, run = command.partition(" .venv/bin/python ")
    env = dict(part.split("=", 1) for part in shlex.split(env_part))
    path = env["PYTHONPATH"].replace(".", str(PROJECT_DIR), 1)
    done = subprocess.run(
        [sys.executable, *shlex.split(run)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path, "TRAIN_LOCAL_DIR": str(tmp_path / "local")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (finished,) = [r for r in records if r.get("event") == "finished"]
    assert finished["step"] == int(shlex.split(run)[shlex.split(run).index("--max-steps") + 1])
    assert list((tmp_path / "runs" / "mine").glob("dcp-manifest-*.json"))


def test_every_relative_link_of_the_readme_and_the_docs_lands() -> None:
    pages = [README, PROJECT_DIR / "CONTRIBUTING.md", *sorted((PROJECT_DIR / "docs").glob("*.md"))]
    wrong = [problem for page in pages for problem in broken_links(page)]
    assert not wrong, "\n".join(wrong)


def test_the_link_checker_finds_a_missing_heading_and_a_missing_file(tmp_path: Path) -> None:
    assert anchors("# A `lab` page: today's numbers\n## A → B\n## A → B\n") == {
        "a-lab-page-todays-numbers", "a--b", "a--b-1",
    }  # fmt: skip
    page = tmp_path / "page.md"
    page.write_text("# Here\n[ok](#here) [gone](#there) [none](other.md) [web](https://x.y/z)\n")
    assert broken_links(page) == [
        "page.md: #there (no such heading in page.md)",
        "page.md: other.md (no such file)",
    ]
