"""A task's options as its source declares them, read without running it.

``pulumi up`` checks ``task`` and ``trainArgs`` before anything is created, on the deployer's
machine. Its Pulumi environment has no torch and none of the task package's own dependencies,
so importing the task there would fail for reasons that say nothing about the task, and would
run the user's code at every preview. The module is found on disk and parsed instead
(``ast``): the ``TrainSpec(...)`` it binds, the options dataclass that call names, and each
option's name, type and default, with ``state_options`` and ``defaults``.

What only exists when the source runs (a spec returned by a function, options from
``make_dataclass``, a dataclass with base classes) cannot be read: the task is then *opaque*,
its ``trainArgs`` names are left to the workers' own check, and ``pulumi up`` says so. A module
that is not there, or that binds no such name, is certain: that is refused.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training import python_source

SPEC_FIELDS = (
    "name",
    "options",
    "load_data",
    "build",
    "collate",
    "loss",
    "evaluate",
    "check",
    "defaults",
    "parallelize",
    "init_weights",
    "state_options",
)
"""``training.api.TrainSpec``'s fields in order, for positional arguments (a test holds them
to the dataclass, which cannot be imported here: it imports torch)."""
KINDS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}
UNKNOWN = object()
"""An option's default that is not a literal (a ``field(default_factory=...)``, a call)."""
_MAX_HOPS = 8
"""``from x import spec`` re-exports followed before giving up."""


class TaskSourceError(ValueError):
    """The task's module or name is certainly not there; the message is one line."""


@dataclass(frozen=True)
class OptionField:
    """One field of a task's options dataclass, as written."""

    name: str
    kind: type | None
    """int, float, bool or str; None when the annotation is another type."""
    default: Any = UNKNOWN


@dataclass(frozen=True)
class TaskSource:
    """What the source of ``reference`` declares."""

    reference: str
    module_file: Path
    options: tuple[OptionField, ...] | None
    """None: opaque (``opaque_because`` says why)."""
    state_options: tuple[str, ...] | None = None
    """The options that shape the saved state; None: all of them (the API's default)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """The task's own defaults for the loop's settings (``TrainSpec.defaults``)."""
    opaque_because: str = ""

    @property
    def readable(self) -> bool:
        """Whether the options were read (else only the workers can check them)."""
        return self.options is not None

    def option(self, name: str) -> OptionField | None:
        """The option called ``name``, if the source declares one."""
        return next((o for o in self.options or () if o.name == name), None)


def module_file(module: str, roots: list[Path]) -> Path | None:
    """Where ``module`` (dotted) lives under the first root that has it, else None."""
    parts = module.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def read_task(reference: str, roots: list[Path]) -> TaskSource:
    """The options of ``module.path:attribute`` as the source under ``roots`` declares them.

    Raises TaskSourceError when the module is in none of the roots, does not parse, or binds
    nothing by that name; returns an opaque source when the name is bound to something only
    running it would tell.
    """
    module, _, attribute = reference.partition(":")
    path = module_file(module, roots)
    if path is None:
        raise TaskSourceError(f"no module {module}")
    if "." in attribute:
        return _opaque(reference, path, f"{attribute} is a dotted name")
    found = _resolve(module, attribute, path, roots, hops=0)
    if isinstance(found, str):
        return _opaque(reference, path, found)
    spec_file, call, tree = found
    return _from_call(reference, spec_file, call, tree, roots)


def _opaque(reference: str, path: Path, why: str) -> TaskSource:
    return TaskSource(reference, path, None, opaque_because=why)


def _parse(path: Path) -> ast.Module:
    try:
        return python_source.parse(path.read_text(encoding="utf-8"), str(path))
    except SyntaxError as exc:
        raise TaskSourceError(f"{path.name} line {exc.lineno}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskSourceError(f"cannot read {path}: {exc}") from None


def _binding(tree: ast.Module, name: str) -> ast.stmt | None:
    """The last top-level statement that binds ``name``."""
    found: ast.stmt | None = None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in stmt.targets
        ):
            found = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found = stmt if stmt.target.id == name and stmt.value else found
        elif isinstance(stmt, ast.ImportFrom | ast.Import):
            if any((a.asname or a.name.split(".")[0]) == name for a in stmt.names):
                found = stmt
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found = stmt if stmt.name == name else found
    return found


def _binds_dynamically(tree: ast.Module) -> bool:
    """``from x import *`` or a module ``__getattr__``: a name may come from elsewhere."""
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
            return True
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__getattr__":
            return True
    return False


def _absolute(module: str, path: Path, stmt: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``module`` (at ``path``) names."""
    if not stmt.level:
        return stmt.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (stmt.level - 1)] if stmt.level > 1 else package
    return ".".join([*base, *([stmt.module] if stmt.module else [])])


def _imported(
    stmt: ast.ImportFrom, name: str, module: str, path: Path, roots: list[Path]
) -> tuple[str, str, Path | None]:
    """Where ``from ... import`` (in ``module``, at ``path``) gets ``name``: the name it has
    there, that module, and its file under ``roots`` (None when it is not in them)."""
    original = next(a.name for a in stmt.names if (a.asname or a.name) == name)
    source = _absolute(module, path, stmt)
    return original, source, module_file(source, roots)


def _resolve(
    module: str, name: str, path: Path, roots: list[Path], hops: int
) -> tuple[Path, ast.Call, ast.Module] | str:
    """The ``TrainSpec(...)`` call ``name`` is bound to (following re-exports), or why not."""
    tree = _parse(path)
    stmt = _binding(tree, name)
    if stmt is None:
        if _binds_dynamically(tree):
            return f"{module} may bind {name} at run time (import * or __getattr__)"
        raise TaskSourceError(f"module {module} has no attribute {name}")
    if isinstance(stmt, ast.ImportFrom) and hops < _MAX_HOPS:
        original, source, target = _imported(stmt, name, module, path, roots)
        if target is None:
            return f"{name} comes from {source}, which is not in the task package"
        return _resolve(source, original, target, roots, hops + 1)
    value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
    if isinstance(value, ast.Call) and _called(value) == "TrainSpec":
        return path, value, tree
    return f"{name} is not bound to a TrainSpec(...) call in {path.name}"


def _called(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _arguments(call: ast.Call) -> dict[str, ast.expr]:
    args = dict(zip(SPEC_FIELDS, call.args, strict=False))
    args.update({k.arg: k.value for k in call.keywords if k.arg})
    return args


def _from_call(
    reference: str, path: Path, call: ast.Call, tree: ast.Module, roots: list[Path]
) -> TaskSource:
    args = _arguments(call)
    options = args.get("options")
    if not isinstance(options, ast.Name):
        return _opaque(reference, path, "its options are not a class named in the call")
    found = _options_class(options.id, tree, path, roots)
    if isinstance(found, str):
        return _opaque(reference, path, found)
    fields = _fields(found)
    if isinstance(fields, str):
        return _opaque(reference, path, fields)
    return TaskSource(
        reference,
        path,
        fields,
        state_options=_state_options(args.get("state_options")),
        defaults=_literal_dict(args.get("defaults")),
    )


def _options_class(
    name: str, tree: ast.Module, path: Path, roots: list[Path], hops: int = 0
) -> ast.ClassDef | str:
    stmt = _binding(tree, name)
    if isinstance(stmt, ast.ClassDef):
        return stmt
    if isinstance(stmt, ast.ImportFrom) and hops < _MAX_HOPS:
        original, _, target = _imported(stmt, name, _module_name(path, roots), path, roots)
        if target is not None:
            return _options_class(original, _parse(target), target, roots, hops + 1)
    return f"its options class {name} is not defined where the source can be read"


def _module_name(path: Path, roots: list[Path]) -> str:
    for root in roots:
        if path.is_relative_to(root):
            parts = path.relative_to(root).with_suffix("").parts
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return path.stem


def _fields(cls: ast.ClassDef) -> tuple[OptionField, ...] | str:
    if cls.bases:
        return f"its options class {cls.name} has base classes"
    fields = []
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        annotation = ast.unparse(stmt.annotation).strip("'\"")
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        fields.append(OptionField(stmt.target.id, KINDS.get(annotation), _default(stmt.value)))
    return tuple(fields)


def _default(value: ast.expr | None) -> Any:
    if value is None:
        return UNKNOWN
    if isinstance(value, ast.Call) and _called(value) == "field":
        given = {k.arg: k.value for k in value.keywords if k.arg}
        return _default(given["default"]) if "default" in given else UNKNOWN
    try:
        return ast.literal_eval(value)
    except ValueError:
        return UNKNOWN


def _state_options(value: ast.expr | None) -> tuple[str, ...] | None:
    """A literal tuple or list of names; None (all options) for anything else, the safe side."""
    if isinstance(value, ast.Tuple | ast.List) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
    ):
        return tuple(e.value for e in value.elts)  # type: ignore[attr-defined]
    return None


def _literal_dict(value: ast.expr | None) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        literal = ast.literal_eval(value)
    except ValueError:
        return {}
    return dict(literal) if isinstance(literal, dict) else {}
