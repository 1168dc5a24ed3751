"""The house's rules, read off the source with ``ast``: each room of ``lab/`` and ``training/``
imports only the rooms docs/architecture.md allows, and no import cycle. Rooms are cut by
concept, not by size: no rule counts lines or modules."""

from __future__ import annotations

import ast
from pathlib import Path

from training import python_source

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("lab", "bench", "infra", "workloads", "stack_config", "catalog", "training")
MAY_IMPORT = {
    "lab.report": (),
    "lab.live": ("lab.report",),
    "lab.local": ("lab.live", "lab.report", "lab.exit_status"),
    "lab.azure": ("lab.live", "lab.report", "lab.exit_status"),
    "training.records": (),
    "training.python_source": (),
    "training.api": (),
    "training.elastic": (),
    "training.checkpoints": (),
    "training.node_agent": ("training.elastic",),
    "training.data": (
        "training.api",
        "training.elastic",
        "training.checkpoints",
        "training.records",
    ),
    "training.tasks": ("training.api", "training.data"),
    "training.settings": ("training.tasks", "training.data", "training.elastic"),
    "training.loop": (
        "training.settings",
        "training.api",
        "training.tasks",
        "training.elastic",
        "training.checkpoints",
        "training.data",
        "training.records",
        "training.python_source",
    ),
}
"""What each room of ``lab/`` and ``training/`` may import from its own package besides itself.
The modules at the top (``lab.cli``; ``training.agent``, ``training.launcher``,
``training.train``) may import every room, and no room imports them."""


def _modules() -> dict[str, Path]:
    """Every module of the checked packages, by dotted name (a package by its own name)."""
    found = {}
    for top in CHECKED:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The checked module that holds ``name``: ``lab.local.node`` for ``lab.local.node.Node``."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(name: str, path: Path) -> set[str]:
    """The checked modules ``name`` imports, at its top or inside a function (on use)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(python_source.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {owner for owner in map(_owner, names) if owner and owner != name}


GRAPH = {name: _imported(name, path) for name, path in MODULES.items()}


def _room(name: str) -> str:
    """``lab.azure.preflight.command`` -> ``lab.azure``; ``lab.cli`` -> ``lab.cli``."""
    return ".".join(name.split(".")[:2])


def _package(name: str) -> str:
    """``lab.azure.preflight.command`` -> ``lab``."""
    return name.split(".")[0]


def test_each_room_of_lab_and_training_imports_only_what_it_may() -> None:
    wrong = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if _room(name) in MAY_IMPORT
        for target in sorted(targets)
        if _package(target) == _package(name)
        and _room(target) != _room(name)
        and _room(target) not in MAY_IMPORT[_room(name)]
    ]
    assert not wrong, "\n".join(wrong)


def test_training_imports_nothing_of_the_repo_outside_it() -> None:
    """The image's build context is ``training/``: nothing else of the repo is in the image."""
    wrong = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if _package(name) == "training"
        for target in sorted(targets)
        if _package(target) != "training"
    ]
    assert not wrong, "\n".join(wrong)


BELOW = {
    "catalog": (),
    "stack_config": ("catalog", "training"),
    "infra": ("catalog", "stack_config", "training"),
    "workloads": ("catalog", "stack_config", "training"),
}
"""What each package of the Pulumi program may import besides itself: the floors run
``__main__.py`` -> ``infra/``, ``workloads/`` -> ``stack_config/`` -> ``catalog/`` (and
``training/``'s torch-free settings), and no arrow runs back up."""


def test_the_pulumi_programs_packages_import_only_the_floors_below() -> None:
    wrong = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if _package(name) in BELOW
        for target in sorted(targets)
        if _package(target) not in (_package(name), *BELOW[_package(name)])
    ]
    assert not wrong, "\n".join(wrong)


def test_the_report_imports_neither_side() -> None:
    report = {t for n, targets in GRAPH.items() if _room(n) == "lab.report" for t in targets}
    assert report, "the report's imports were not found"
    assert not {t for t in report if _room(t) in ("lab.local", "lab.azure")}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as the path around it, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycle_between_modules_or_between_rooms() -> None:
    assert _cycle(GRAPH) == []
    rooms: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        if _package(name) in ("lab", "training") and name != _package(name):
            rooms.setdefault(_room(name), set()).update(
                _room(t)
                for t in targets
                if _package(t) == _package(name) and _room(t) not in (_room(name), _package(t))
            )
    assert set(MAY_IMPORT) <= set(rooms)
    assert _cycle(rooms) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def _imports_pulumi(path: Path) -> bool:
    for node in ast.walk(python_source.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.startswith("pulumi") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pulumi"):
            return True
    return False


def test_the_labs_tools_load_no_pulumi_sdk() -> None:
    """``lab/`` reads infra's pure catalogues (``catalog/``, ``infra/node_pools.py``), never
    a module that imports pulumi: the tools start fast and need no Pulumi engine."""
    with_pulumi = {name for name, path in MODULES.items() if _imports_pulumi(path)}
    assert "infra.cluster" in with_pulumi  # the finder finds one
    wrong = []
    for start in (name for name in MODULES if name.startswith("lab")):
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name in with_pulumi:
                wrong.append(f"{start} reaches {name}")
                break
            seen.add(name)
            todo += [t for t in GRAPH.get(name, ()) if t not in seen]
    assert not wrong, "\n".join(wrong)


def test_the_architecture_page_names_the_rooms_and_their_imports_this_module_holds() -> None:
    """docs/architecture.md's table of rooms is ``MAY_IMPORT``: each room, and what it may
    import of its own package, or "nothing"."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("| room | what it holds | may import") :].split("\n\n")[0]
    documented = {}
    for row in table.splitlines()[2:]:
        room, _, may = (cell.strip() for cell in row.strip("|").split(" | "))
        name = room.strip("`/").replace("/", ".")
        package = name.split(".")[0]
        targets = [] if may == "nothing" else [t.strip("` ") for t in may.split(",")]
        documented[name] = tuple(sorted(f"{package}.{t}" for t in targets))
    assert documented == {room: tuple(sorted(may)) for room, may in MAY_IMPORT.items()}


def _exit_code_names(tree: ast.AST) -> list[str]:
    """Names bound to an exit code outside the table: ``EXIT_*`` assigned an int or a name."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, float):
            continue  # a time: EXIT_BARRIER_TIMEOUT_S
        for target in node.targets:
            for name in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(name, ast.Name) and name.id.startswith("EXIT_"):
                    found.append(f"{name.id} (line {node.lineno})")
    return found


def test_exit_codes_come_from_the_one_table() -> None:
    """``training/elastic/exit_codes.py`` is the table (0 done, 1 failed, 2 bad input, 75, 138,
    ...): nobody defines a code of their own, nor an alias of one."""
    wrong = [
        f"{name}: {found}"
        for name, path in MODULES.items()
        for found in _exit_code_names(python_source.parse(path.read_text(), str(path)))
    ]
    assert not wrong, "\n".join(wrong)
    aliases = "EXIT_OK, EXIT_FAILED = 0, 1\nEXIT_BAD_INPUT = BAD_INPUT\nEXIT_WAIT_S = 1.5\n"
    assert _exit_code_names(python_source.parse(aliases)) == [
        "EXIT_OK (line 1)",
        "EXIT_FAILED (line 1)",
        "EXIT_BAD_INPUT (line 2)",
    ]


def _test_module_imports(root: Path) -> list[str]:
    """Imports of a test module (``test_*.py``) anywhere under ``root``, by any module there."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(python_source.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            if any(part.startswith("test_") for name in names for part in name.split(".")):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_test_module_imports_another() -> None:
    """What tests share lives in ``tests/support/`` (or a folder's ``conftest.py``), never in a
    ``test_*.py`` another one imports: a module of tests holds tests."""
    wrong = _test_module_imports(REPO / "tests")
    assert not wrong, "\n".join(wrong)


def test_the_test_import_finder_finds_one(tmp_path: Path) -> None:
    (tmp_path / "test_b.py").write_text(
        "from tests.a.test_a import helper\nimport tests.test_c\nfrom tests.support import x\n"
    )
    assert _test_module_imports(tmp_path) == ["test_b.py:1", "test_b.py:2"]
