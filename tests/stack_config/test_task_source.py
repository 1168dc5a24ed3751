"""stack_config.task_source: a task's options read from its source, never imported."""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from stack_config.task_package import IMAGE_ROOT, builtin_reference
from stack_config.task_source import (
    SPEC_FIELDS,
    UNKNOWN,
    TaskSourceError,
    module_file,
    read_task,
)
from tests.support.user_package import write_user_package
from training.tasks import TASK_NAMES

OPTIONS = '''
from dataclasses import dataclass, field

@dataclass
class Opts:
    width: int = 8
    """Hidden units."""
    rate: float = 0.5
    name: str = "x"
    flag: bool = False
    made: list = field(default_factory=list)
    chosen: int = field(default=3)
'''


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_spec_fields_are_the_train_specs_in_order() -> None:
    from training.api import TrainSpec

    assert tuple(f.name for f in fields(TrainSpec)) == SPEC_FIELDS


@pytest.mark.parametrize("task", TASK_NAMES)
def test_a_built_in_tasks_source_says_what_its_spec_holds(task: str) -> None:
    from training.tasks import TASKS

    source = read_task(builtin_reference(task), [IMAGE_ROOT])
    spec = TASKS[task]
    declared = {f.name: f.default for f in fields(spec.options) if f.default is not MISSING}
    assert {o.name: o.default for o in source.options or ()} == declared
    assert {o.name: o.kind for o in source.options or ()} == {
        f.name: type(f.default) for f in fields(spec.options)
    }
    assert source.state_options == spec.state_options
    assert dict(source.defaults) == dict(spec.defaults)


def test_the_user_package_is_read_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another test of this process may have imported the package: start without it.
    for name in [n for n in sys.modules if n == "mytask" or n.startswith("mytask.")]:
        monkeypatch.delitem(sys.modules, name)
    package = write_user_package(tmp_path)
    source = read_task("mytask.model:spec", [package])
    assert [(o.name, o.kind, o.default) for o in source.options or ()] == [
        ("width", int, 8),
        ("validation", int, 16),
    ]
    assert source.state_options == ("width",)
    assert not [n for n in sys.modules if n == "mytask" or n.startswith("mytask.")]


def test_positional_and_keyword_arguments_and_literal_defaults(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/task.py": OPTIONS
            + "spec = TrainSpec('t', Opts, a, b, c, d, state_options=['width'], "
            "defaults={'lr': 0.1})\n",
        },
    )
    source = read_task("pkg.task:spec", [root])
    assert {o.name: o.default for o in source.options or ()} == {
        "width": 8,
        "rate": 0.5,
        "name": "x",
        "flag": False,
        "made": UNKNOWN,
        "chosen": 3,
    }
    assert source.option("flag") is not None and source.option("flag").kind is bool
    assert source.state_options == ("width",) and source.defaults == {"lr": 0.1}


def test_a_re_exported_spec_and_imported_options_are_followed(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from .task import spec\n",
            "pkg/options.py": OPTIONS,
            "pkg/task.py": "from pkg.options import Opts\n"
            "import training.api as api\n"
            "spec = api.TrainSpec(name='t', options=Opts, load_data=a, build=b, collate=c, "
            "loss=d)\n",
        },
    )
    source = read_task("pkg:spec", [root])
    assert source.readable and source.state_options is None  # every option, the safe default
    assert source.module_file == root / "pkg" / "task.py"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("spec = make_spec()\n", "not bound to a TrainSpec(...) call"),
        ("def spec():\n    pass\n", "not bound to a TrainSpec(...) call"),
        ("from other import *\n", "may bind spec at run time"),
        ("from elsewhere import spec\n", "comes from elsewhere, which is not in the task package"),
        ("spec = TrainSpec('t', make_options(), a, b, c, d)\n", "not a class named"),
        (
            "class B:\n    pass\nclass O(B):\n    w: int = 1\n"
            "spec = TrainSpec('t', O, a, b, c, d)\n",
            "has base classes",
        ),
    ],
)
def test_what_only_running_it_would_tell_is_opaque(tmp_path: Path, text: str, why: str) -> None:
    root = _package(tmp_path, {"pkg/__init__.py": "", "pkg/task.py": text})
    source = read_task("pkg.task:spec", [root])
    assert not source.readable and why in source.opaque_because


def test_a_missing_module_attribute_or_syntax_is_certain(tmp_path: Path) -> None:
    root = _package(tmp_path, {"pkg/__init__.py": "", "pkg/task.py": "other = 1\n"})
    with pytest.raises(TaskSourceError, match="no module pkg.nothere"):
        read_task("pkg.nothere:spec", [root])
    with pytest.raises(TaskSourceError, match="module pkg.task has no attribute spec"):
        read_task("pkg.task:spec", [root])
    (root / "pkg" / "bad.py").write_text("spec = (\n")
    with pytest.raises(TaskSourceError, match="bad.py line 1"):
        read_task("pkg.bad:spec", [root])


def test_a_package_module_is_its_init(tmp_path: Path) -> None:
    root = _package(tmp_path, {"pkg/sub/__init__.py": ""})
    assert module_file("pkg.sub", [root]) == root / "pkg" / "sub" / "__init__.py"
    assert module_file("pkg.other", [root]) is None
