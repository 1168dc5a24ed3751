"""``trainArgs``: the training flags a stack sets, checked against the loop and the task.

Each key is a flag of the training loop (``training/loop/settings.py``: lr, micro-batch-size,
eval-every, seed, compile, init-from, ...) or an option of the task (read from its source,
``stack_config/task_source.py``), written with '-' or '_'. A key the stack config already
owns (maxSteps, globalBatchSize, precision, ...) is refused: one flag, one way to set it. Under
``script`` the keys are the script's own arguments and are not checked.

The run's identity, as ``up`` knows it, is what a checkpoint must match to be resumed
(``training/loop/inputs.py``, ``run_identity``): the task, its state options, the seed, the
global batch, the precision, the dtype. It names the checkpoints' folder (``lineage``), and a
change of it under the same ``runId`` is refused (``identity_problem``). Pure: no I/O.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from stack_config.model import ConfigError, LabConfig, TrainingRun
from stack_config.task_source import UNKNOWN, TaskSource
from training.loop.settings import LOOP_SECTIONS

_LOOP_FIELDS = [f for section in LOOP_SECTIONS for f in fields(section)]
LOOP_FLAGS: dict[str, type] = {f.name: type(f.default) for f in _LOOP_FIELDS}
"""Every flag of the training loop (by field name) and its type."""
OWNED: dict[str, str | None] = {
    "task": "task",
    "max_steps": "maxSteps",
    "global_batch_size": "globalBatchSize",
    "precision": "precision",
    "parallelism": "parallelism",
    "checkpoint_every_steps": "checkpointEverySteps",
    "checkpoint_every_seconds": "checkpointEverySeconds",
    "collective_timeout_s": "collectiveTimeoutSeconds",
    "stop_deadline_s": "terminationGraceSeconds",
    "checkpoint_uri": None,
    "local_dir": None,
    "data_dir": None,
}
"""Loop flags the job sets from a stack key (or from its own storage: None)."""
IDENTITY_FLAGS = ("seed", "dtype")
"""Loop flags ``trainArgs`` may set that are part of the run's identity."""
LOOP_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in _LOOP_FIELDS if f.name in IDENTITY_FLAGS
}
"""Their defaults, the loop's own (``training/loop/settings.py``)."""
_KEY = re.compile(r"^-{0,2}([A-Za-z][A-Za-z0-9_-]*)$")


def field_name(key: str) -> str:
    """``micro-batch-size``, ``--micro-batch-size`` or ``micro_batch_size``: the field's name."""
    match = _KEY.match(key)
    return match.group(1).replace("-", "_") if match else key


def flag(name: str) -> str:
    """A field's flag: ``micro_batch_size`` -> ``--micro-batch-size``."""
    return "--" + name.replace("_", "-")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _typed(value: Any, kind: type | None) -> Any:
    """``value`` as ``kind`` (a string as the CLI's ``--path`` stores it, too); ValueError."""
    if kind is None:
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ValueError("true or false")
    if kind in (int, float):
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise ValueError("an integer" if kind is int else "a number")
        try:
            return kind(value.strip() if isinstance(value, str) else value)
        except ValueError:
            raise ValueError("an integer" if kind is int else "a number") from None
    return str(value)


def _known(cfg: LabConfig, source: TaskSource | None, key: str) -> str:
    """Why ``key`` is no flag here, with the nearest names: one line."""
    options = [o.name for o in (source.options or ())] if source else []
    names = sorted(n for n in LOOP_FLAGS if n not in OWNED) + options
    near = difflib.get_close_matches(field_name(key), names, n=1)
    hint = f" (did you mean {near[0].replace('_', '-')}?)" if near else ""
    return (
        f"{cfg.key('trainArgs')}.{key} is neither a flag of the training loop nor an option of "
        f"{cfg.key('task')} {cfg.task}{hint}; the task's options: "
        f"{', '.join(o.replace('_', '-') for o in options) or 'none'}; the loop's: "
        f"{', '.join(n.replace('_', '-') for n in sorted(LOOP_FLAGS) if n not in OWNED)}"
    )


def shadowing_problems(cfg: LabConfig, source: TaskSource) -> list[str]:
    """A task option named like a loop flag would take that flag's place: refused by name."""
    return [
        f"{cfg.key('task')} {cfg.task}: its option {o.name} ({source.module_file.name}) has the "
        f"name of the training loop's {flag(o.name)}; rename the option (e.g. task_{o.name})"
        for o in source.options or ()
        if o.name in LOOP_FLAGS
    ]


def loop_values(cfg: LabConfig, source: TaskSource | None) -> tuple[dict[str, Any], list[str]]:
    """The trainArgs as typed values by field name, and the problems; for the loop's job."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, raw in sorted(cfg.job.train_args.items()):
        name, where = field_name(key), f"{cfg.key('trainArgs')}.{key}"
        if not _KEY.match(key):
            problems.append(f"{where}: a flag name is letters, digits, '-' or '_'")
            continue
        if name in values:
            problems.append(f"{where} sets {flag(name)} a second time")
            continue
        if name in OWNED:
            owner = OWNED[name]
            problems.append(
                f"{where} sets {flag(name)}, which the stack key {cfg.key(owner)} sets too: "
                "set it there only"
                if owner
                else f"{where} sets {flag(name)}, which the job sets itself (the stack's storage)"
            )
            continue
        option = source.option(name) if source else None
        unknown = name not in LOOP_FLAGS and option is None
        if unknown and (source is None or source.readable):
            problems.append(_known(cfg, source, key))
            continue
        kind = LOOP_FLAGS.get(name) or (option.kind if option else None)
        try:
            values[name] = _typed(raw, kind)
        except ValueError as exc:
            problems.append(f"{where} must be {exc}, got {raw!r}")
    return values, problems


def script_flags(train_args: Mapping[str, Any]) -> tuple[str, ...]:
    """A script's arguments: ``--name=value``; true is ``--name`` alone, false leaves it out."""
    flags: list[str] = []
    for key, value in sorted(train_args.items()):
        if value is True:
            flags.append(f"--{key.lstrip('-')}")
        elif value is not False:
            flags.append(f"--{key.lstrip('-')}={_text(value)}")
    return tuple(flags)


def identity(cfg: LabConfig, source: TaskSource | None, values: Mapping[str, Any]) -> dict:
    """The run's identity as ``up`` knows it (``training/loop/inputs.py`` has the whole one,
    which adds the dataset's digest)."""
    defaults = source.defaults if source else {}
    ident: dict[str, Any] = {
        "task": cfg.task,
        "global_batch_size": cfg.job.global_batch_size,
        "precision": cfg.job.precision,
    }
    for name in IDENTITY_FLAGS:
        ident[name] = values.get(name, defaults.get(name, LOOP_DEFAULTS[name]))
    if source is None:
        return ident
    if source.readable:
        shaping = source.state_options
        for option in source.options or ():
            if shaping is None or option.name in shaping:
                value = values.get(option.name, option.default)
                if value is not UNKNOWN:
                    ident[f"option.{option.name}"] = value
    else:  # only what trainArgs sets is known, and every option may shape the state
        ident |= {f"option.{k}": v for k, v in values.items() if k not in LOOP_FLAGS}
    return ident


def is_default_shape(ident: Mapping[str, Any], source: TaskSource | None, builtin: bool) -> bool:
    """A built-in task with its state options, seed and dtype at their defaults: the shape of
    runs that share the job's own checkpoints folder (a stack's existing runs keep theirs)."""
    if not builtin or source is None or not source.readable:
        return False
    if any(ident.get(k) != LOOP_DEFAULTS[k] for k in IDENTITY_FLAGS):
        return False
    return all(
        ident[f"option.{o.name}"] == o.default
        for o in source.options or ()
        if f"option.{o.name}" in ident
    )


def lineage(ident: Mapping[str, Any], default_shape: bool) -> str:
    """The checkpoints' folder of this identity: "" (the job's own) or a digest of it."""
    if default_shape:
        return ""
    canonical = json.dumps(dict(ident), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def training_run(
    cfg: LabConfig, source: TaskSource | None, builtin: bool, package_dir: str
) -> TrainingRun:
    """The flags, identity and lineage of the stack's run; ConfigError listing every problem.

    ``source`` is None for a ``script``: its arguments are its own, and all the lab knows of
    what its checkpoints mean is which script writes them.
    """
    if cfg.job.script:
        ident = {"script": cfg.job.script}
        return TrainingRun(
            script_flags(cfg.job.train_args), ident, lineage(ident, False), package_dir
        )
    problems = shadowing_problems(cfg, source) if source else []
    values, arg_problems = loop_values(cfg, source)
    problems += arg_problems
    if problems:
        raise ConfigError(problems)
    ident = identity(cfg, source, values)
    default_shape = is_default_shape(ident, source, builtin)
    flags = tuple(f"{flag(name)}={_text(value)}" for name, value in sorted(values.items()))
    return TrainingRun(flags, ident, lineage(ident, default_shape), package_dir)


def _setting(cfg: LabConfig, name: str) -> str:
    """The stack setting an identity entry comes from, as the user types it."""
    keys = {"task": "task", "global_batch_size": "globalBatchSize", "precision": "precision"}
    if name in keys:
        return cfg.key(keys[name])
    return f"{cfg.key('trainArgs')}.{name.removeprefix('option.').replace('_', '-')}"


def identity_problem(cfg: LabConfig, recorded: Mapping[str, Any]) -> str | None:
    """Why the run recorded for this ``runId`` cannot go on under the stack's settings, or None.

    ``recorded`` is what the run's record held when this ``runId`` started: ``runId``, and its
    ``identity`` and ``lineage``. Two runs in the job's own folder (the built-in tasks at their
    default shape) are left to the workers: they refuse another run's checkpoint with exit 2.
    """
    if str(recorded.get("runId")) != cfg.job.run_id:
        return None
    old: dict[str, Any] = json.loads(recorded.get("identity") or "{}")
    new = json.loads(json.dumps(dict(cfg.training.identity), default=str))
    if old == new or (not recorded.get("lineage") and not cfg.training.lineage):
        return None
    # What the record holds: a setting it has no value for came later (a new option, a newer
    # lab), and the workers judge it as they do a checkpoint written before it existed.
    changed = sorted(k for k in old if old[k] != new.get(k))
    if not changed:
        return None
    what = "; ".join(
        f"{_setting(cfg, k)} was {old.get(k, 'unset')!r}, now {new.get(k, 'unset')!r}"
        for k in changed
    )
    run = cfg.job.run_id
    if old.get("script") != new.get("script"):
        programs = [
            f"script {p}" if p else "the lab's training loop"
            for p in (old.get("script"), new.get("script"))
        ]
        return (
            f"{cfg.key('script')}: run {run} ran {programs[0]}, the stack now runs {programs[1]}; "
            f"another program is another run: set {cfg.key('runId')} to a new value"
        )
    return (
        f"{what}: that shapes what run {run}'s checkpoints hold, so run {run} cannot resume "
        f"with it; set {cfg.key('runId')} to a new value to start a new run (its checkpoints "
        f"get their own folder and run {run}'s stay), or set it back"
    )
