"""The training program's configuration: defaults, then ``TRAIN_*`` env, then CLI flags.

One dataclass per section (``training/loop/settings.py``, torch-free, which the stack's config
reads too); every field has a default and a docstring. Each field is a flag
(``--checkpoint-uri``) with an env fallback (``TRAIN_CHECKPOINT_URI``), so the PyTorchJob can set
per-cluster values as env while the command line stays the same everywhere. The task
(``--task``, training/tasks/) adds its own options as one more section, and may change the
loop's defaults (its ``TrainSpec.defaults``): defaults, the task's defaults, env, flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from typing import TYPE_CHECKING, Any

from training import python_source
from training.loop import settings
from training.loop.settings import (
    LOOP_SECTIONS,
    CheckpointConfig,
    DataConfig,
    OptimConfig,
    RunConfig,
)
from training.settings import PARALLELISMS, PRECISIONS
from training.tasks import (
    DEFAULT_TASK,
    REFERENCE_FORM,
    TASK_NAMES,
    TASKS,
    TaskImportError,
)

if TYPE_CHECKING:
    from training.api import TrainSpec

ENV_PREFIX = "TRAIN_"
DTYPES = ("float32", "float64")
MAX_STOP_DEADLINE_S = 600.0
"""A longer termination grace than this is no eviction notice anyone gets."""


class ConfigError(ValueError):
    """A flag or env value is wrong; the message names it and what is allowed."""


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    options: Any = field(default_factory=lambda: TASKS[DEFAULT_TASK].options())
    """The task's own options (its ``TrainSpec.options`` dataclass)."""

    def sections(self) -> list[Any]:
        return [self.data, self.optim, self.checkpoint, self.run, self.options]

    @property
    def spec(self) -> TrainSpec:
        """The task this config trains."""
        return TASKS[self.run.task]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(s, f.name) for s in self.sections() for f in fields(s)}


@cache
def _field_docs(module_name: str) -> dict[str, str]:
    """Every dataclass field's docstring (the string under it) in a module, for ``--help``."""
    module = python_source.parse(inspect.getsource(sys.modules[module_name]))
    docs: dict[str, str] = {}
    for section in (node for node in module.body if isinstance(node, ast.ClassDef)):
        for node, doc in itertools.pairwise(section.body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                docs[node.target.id] = " ".join(doc.value.value.split())
    return docs


# Once, at import: the fork server imports this module, so a worker's restart does not pay
# for reading the source again. The tasks too, where torch is loaded already (the fork server
# imports it first): elsewhere (``python -m lab --help``, a scenario's check) they would import
# torch for nothing, and a task loads on first use of its spec.
FIELD_DOCS = _field_docs(settings.__name__)
if "torch" in sys.modules:
    for _spec in TASKS.values():
        _field_docs(_spec.options.__module__)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _convert(raw: str, kind: type, where: str) -> Any:
    if kind is bool:
        if raw.lower() not in _BOOLEANS:
            raise ConfigError(f"{where} must be true or false, got {raw!r}")
        return _BOOLEANS[raw.lower()]
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{where} must be {kind.__name__}, got {raw!r}") from None


def parse_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> TrainConfig:
    """Build the config from defaults, ``TRAIN_*`` env and flags, then validate it."""
    env = os.environ if env is None else env
    cfg = _task_config(argv, env)
    parser = argparse.ArgumentParser(prog="training.train", description=__doc__, allow_abbrev=False)
    docs = {**_field_docs(type(cfg.options).__module__), **FIELD_DOCS}
    for section in cfg.sections():
        for f in fields(section):
            about = docs.get(f.name, "").replace("%", "%%")  # argparse %-formats help
            default = getattr(section, f.name)
            if f.name == "task":  # the names, which the field's docstring cannot list
                about = f"{about} One of: {', '.join(TASK_NAMES)}. Or {REFERENCE_FORM}."
            if f.name == "data_dir":  # what this task reads there
                about = f"{about} {cfg.run.task}: {_data_doc(cfg.spec)}"
            parser.add_argument(
                _flag(f.name),
                default=None,
                metavar="{" + ",".join(TASK_NAMES) + "}" if f.name == "task" else None,
                help=f"{about} (env {ENV_PREFIX}{f.name.upper()}, default {default!r})",
            )
    args = parser.parse_args(argv)
    for section in cfg.sections():
        for f in fields(section):
            kind = type(getattr(section, f.name))
            cli = getattr(args, f.name)
            env_value = env.get(ENV_PREFIX + f.name.upper())
            if cli is not None:
                setattr(section, f.name, _convert(cli, kind, _flag(f.name)))
            elif env_value:
                setattr(section, f.name, _convert(env_value, kind, ENV_PREFIX + f.name.upper()))
    validate(cfg)
    return cfg


def _data_doc(spec: TrainSpec) -> str:
    """The first paragraph of the task's ``load_data`` docstring: what ``--data-dir`` holds."""
    doc = " ".join((inspect.getdoc(spec.load_data) or "").split("\n\n")[0].split())
    return doc or "its load_data(data_dir, options) says nothing of it (give it a docstring)"


def check_options(name: str, spec: TrainSpec) -> None:
    """ConfigError when the task's options are no dataclass, or one is named like a loop
    flag (``lr``): the task's flag would shadow the loop's, and argparse would only crash."""
    if not dataclasses.is_dataclass(spec.options):
        raise ConfigError(f"task {name}: TrainSpec.options must be a dataclass of its settings")
    loop = {f.name for section in LOOP_SECTIONS for f in fields(section)}
    for option in fields(spec.options):
        if option.name in loop:
            raise ConfigError(
                f"task {name}: option {option.name!r} of {spec.options.__name__} is named like "
                f"the loop's own flag {_flag(option.name)}: rename it (the loop's "
                f"{_flag(option.name)} is what BuildContext and TrainParts hand over)"
            )


def _task_config(argv: Sequence[str] | None, env: Mapping[str, str]) -> TrainConfig:
    """The config of the task ``--task`` (or ``TRAIN_TASK``) names, with its defaults."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--task", default=None)
    name = probe.parse_known_args(argv)[0].task or env.get(ENV_PREFIX + "TASK") or DEFAULT_TASK
    spec = task_spec(name)
    check_options(name, spec)
    cfg = TrainConfig(options=spec.options())
    cfg.run.task = name
    for key, value in spec.defaults.items():
        section = next((s for s in cfg.sections()[:-1] if hasattr(s, key)), None)
        if section is None:
            raise ConfigError(f"task {name!r} sets a default for {key!r}, which is no setting")
        setattr(section, key, value)
    return cfg


def task_spec(name: str) -> TrainSpec:
    """The spec ``--task`` names: a built-in task, or the user's ``module.path:attribute``;
    ConfigError naming ``--task`` and what was found."""
    flag = f"--task (or {ENV_PREFIX}TASK)"
    if name not in TASKS:
        raise ConfigError(
            f"{flag} must be one of {', '.join(TASK_NAMES)} or a TrainSpec of your own module "
            f"as {REFERENCE_FORM}, got {name!r}"
        )
    try:
        return TASKS[name]
    except TaskImportError as exc:
        raise ConfigError(f"{flag} {name}: {exc}") from None


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError naming the flag when a value is out of range."""
    required = {"data_dir": cfg.data.data_dir, "checkpoint_uri": cfg.checkpoint.checkpoint_uri}
    for name, value in required.items():
        if not value:
            raise ConfigError(f"{_flag(name)} (or {ENV_PREFIX}{name.upper()}) is required")
    at_least = {
        "global_batch_size": (cfg.optim.global_batch_size, 1),
        "micro_batch_size": (cfg.optim.micro_batch_size, 1),
        "checkpoint_every_steps": (cfg.checkpoint.checkpoint_every_steps, 0),
        "checkpoint_every_seconds": (cfg.checkpoint.checkpoint_every_seconds, 0),
        "checkpoint_keep": (cfg.checkpoint.checkpoint_keep, 1),
        "max_steps": (cfg.run.max_steps, 1),
        "log_every": (cfg.run.log_every, 1),
        "collective_timeout_s": (cfg.run.collective_timeout_s, 1),
        "restore_timeout_s": (cfg.checkpoint.restore_timeout_s, 1),
        "seed": (cfg.run.seed, 0),
        "min_step_time_s": (cfg.run.min_step_time_s, 0),
        "eval_every": (cfg.run.eval_every, 0),
        "loader_workers": (cfg.data.loader_workers, 0),
        "prefetch_steps": (cfg.data.prefetch_steps, 0),
    }
    for name, (value, low) in at_least.items():
        if value < low:
            raise ConfigError(f"{_flag(name)} must be >= {low}, got {value}")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {cfg.optim.lr}")
    if not 1 <= cfg.checkpoint.stop_deadline_s <= MAX_STOP_DEADLINE_S:
        raise ConfigError(
            f"--stop-deadline-s (or TRAIN_STOP_DEADLINE_S) must be between 1 and "
            f"{MAX_STOP_DEADLINE_S:g} seconds, got {cfg.checkpoint.stop_deadline_s:g}: keep it "
            "below the pod's termination grace (30 s on a spot eviction)"
        )
    if cfg.run.dtype not in DTYPES:
        raise ConfigError(
            f"--dtype (or TRAIN_DTYPE) must be one of {', '.join(DTYPES)}, got {cfg.run.dtype!r}"
        )
    if cfg.run.precision not in PRECISIONS:
        raise ConfigError(
            f"--precision (or TRAIN_PRECISION) must be one of {', '.join(PRECISIONS)}, "
            f"got {cfg.run.precision!r}"
        )
    if cfg.run.precision != "fp32" and cfg.run.dtype != "float32":
        raise ConfigError(
            f"--precision {cfg.run.precision} computes from float32 parameters: --dtype (or "
            f"TRAIN_DTYPE) must be float32 with it, got {cfg.run.dtype}"
        )
    _validate_parallelism(cfg)
    unknown = sorted(set(cfg.spec.state_options or ()) - {f.name for f in fields(cfg.options)})
    if unknown:
        raise ConfigError(f"task {cfg.run.task}: state_options names no option: {unknown}")
    if cfg.spec.check is not None:
        try:
            cfg.spec.check(cfg.options)
        except ValueError as exc:
            raise ConfigError(f"task {cfg.run.task}: {exc}") from None


def _validate_parallelism(cfg: TrainConfig) -> None:
    """``--parallelism`` and what fsdp2 cannot combine with: one line naming the flag, the
    task or option, and the alternative."""
    run, flag = cfg.run, f"--parallelism (or {ENV_PREFIX}PARALLELISM)"
    if run.parallelism not in PARALLELISMS:
        raise ConfigError(
            f"{flag} must be one of {', '.join(PARALLELISMS)}, got {run.parallelism!r}"
        )
    if run.parallelism != "fsdp2":
        return
    spec = cfg.spec
    if spec.parallelize is None or spec.init_weights is None:
        raise ConfigError(
            f"{flag} fsdp2: task {run.task} cannot be sharded (its TrainSpec has no "
            "parallelize and init_weights: docs/your-own-model.md); use --parallelism ddp"
        )


def check_batch_fits(cfg: TrainConfig, num_samples: int | None, world_size: int) -> None:
    """Raise ConfigError when the global batch cannot be split: checked before any collective.

    An epoch must hold at least one full global batch (None: a stream, of no known length),
    and every rank needs at least one sample of it.
    """
    batch = cfg.optim.global_batch_size
    if world_size <= batch <= (batch if num_samples is None else num_samples):
        return
    flag = f"{_flag('global_batch_size')} (or {ENV_PREFIX}GLOBAL_BATCH_SIZE)"
    raise ConfigError(
        f"{flag} must be between {world_size} (the world size: every rank needs a sample) "
        f"and {num_samples} (the training samples in --data-dir), got {batch}"
    )
