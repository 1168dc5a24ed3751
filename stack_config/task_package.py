"""The user's task package and task, as the deployer's machine holds them: checked before
``pulumi up`` registers anything, and resolved into what the workers run.

``taskPackage`` is a directory whose contents go on the image's import path (``/app``), so
``task: mytask.model:spec`` names ``mytask/model.py`` in it. Here the program reads, without
running any of it (``stack_config/task_source.py``): whether the task's module and name are
there; the task's options, for ``trainArgs``; what the image build would send (every file its
``.dockerignore`` lets through, ``catalog/build_context.py``), which must hold no repository
history, virtualenv or second ``training`` package; and the ``script`` a torchrun job runs.
``package_problems`` holds the rules the config alone decides (``validate`` runs them);
``resolve`` is the only code of ``stack_config`` that reads files: ``load`` and ``validate``
stay pure.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import training
from catalog.build_context import DOCKERIGNORE, context_files
from stack_config.model import NO_STAGING, TASKS, ConfigError, LabConfig
from stack_config.task_source import TaskSource, TaskSourceError, read_task
from stack_config.train_args import training_run
from training.settings import LAUNCHERS, TASK_NAMES, is_task_reference

REQUIREMENTS = "requirements.txt"
LARGE_CONTEXT_BYTES = 100 * 1024 * 1024
"""Above this the build context is worth a warning: data belongs in the data container."""
_PINNED = re.compile(r"^[A-Za-z0-9._\[\],-]+\s*===?\s*[^\s;]+")
IMAGE_ROOT = Path(training.__file__).resolve().parent.parent
"""Where the image's own ``training`` package comes from: the built-in tasks' source."""
_RESERVED = ("training",)
"""Top-level names of the lab's image in ``/app``: a package holding one would replace it."""
# A folder of the data container: Blob names, relative, '/'-separated.
DATA_PREFIX = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*/?$")


def package_problems(cfg: LabConfig) -> list[str]:
    """The rules of the package, the launcher, the script and the data prefix that the config
    alone decides (``validate`` runs them; ``resolve`` reads the files)."""
    job, problems = cfg.job, []
    if job.launcher not in LAUNCHERS:
        problems.append(
            f"{cfg.key('launcher')} must be one of {', '.join(LAUNCHERS)}; got {job.launcher!r}"
        )
    in_image = cfg.task.startswith("training.")
    if is_task_reference(cfg.task) and not cfg.task_package and not in_image and not job.script:
        problems.append(
            f"{cfg.key('task')} {cfg.task} is neither a built-in task ({', '.join(TASKS)}) nor "
            f"in the image: set {cfg.key('taskPackage')} to the directory that holds "
            f"{cfg.task.partition('.')[0].partition(':')[0]}/"
        )
    if job.script:
        parts = job.script.replace("\\", "/").split("/")
        if job.launcher != "torchrun":
            problems.append(
                f"{cfg.key('script')} runs under plain torchrun: set {cfg.key('launcher')} "
                f"to torchrun (got {job.launcher!r})"
            )
        if not cfg.task_package:
            problems.append(f"{cfg.key('script')} is a path in {cfg.key('taskPackage')}: set it")
        if job.script.startswith("/") or ".." in parts or not job.script.endswith(".py"):
            problems.append(
                f"{cfg.key('script')} must be a .py file's path inside {cfg.key('taskPackage')} "
                f"(relative, no '..'), got {job.script!r}"
            )
    prefix = cfg.data.prefix
    if prefix and (not DATA_PREFIX.match(prefix) or ".." in prefix.split("/")):
        problems.append(
            f"{cfg.key('dataPrefix')} must be a folder of the data container such as "
            f"points/2026-11 (letters, digits, '.', '-', '_' and '/'; no '..'), got {prefix!r}"
        )
    elif prefix and cfg.data.staged:
        problems.append(
            f"{cfg.key('dataPrefix')} {prefix}: staging writes the container's top, so set "
            f"{cfg.key('dataSourceUrl')} to {NO_STAGING!r} and upload the data there yourself"
        )
    return problems


def package_dir(cfg: LabConfig, project_dir: Path) -> Path | None:
    """``taskPackage`` as an absolute path (relative ones start at the project directory)."""
    if not cfg.task_package:
        return None
    path = Path(cfg.task_package).expanduser()
    return (path if path.is_absolute() else project_dir / path).resolve()


def builtin_reference(task: str) -> str:
    """The module and name of a built-in task (``training/tasks/__init__.py``'s registry)."""
    return f"training.tasks.{task}:SPEC"


def context_problems(cfg: LabConfig, root: Path) -> list[str]:
    """What the image build would send that it must not: each with the fix, one line."""
    where = f"{cfg.key('taskPackage')} {root}"
    sent = [p.relative_to(root) for p in context_files(root, dockerfile="")]
    problems = []
    if any(p.parts[0] == ".git" for p in sent):
        problems.append(
            f"{where}: the image build would send .git (the repository's history, and a new tag "
            f"on every commit): add the line .git to {root / '.dockerignore'}"
        )
    venvs = sorted({p.parent for p in sent if p.name == "pyvenv.cfg"})
    if venvs:
        problems.append(
            f"{where}: the image build would send the virtualenv {venvs[0]}: add it to "
            f"{root / '.dockerignore'} (the image installs {REQUIREMENTS})"
        )
    if cfg.image_builder == "acr":
        problems += acr_ignore_problems(cfg, root, sent)
    clashes = sorted({p.parts[0] for p in sent if Path(p.parts[0]).stem in _RESERVED})
    if clashes:
        problems.append(
            f"{where} holds {clashes[0]} at its top: it would replace the lab's own training "
            "package in the image's /app; rename it, or leave it out with .dockerignore"
        )
    return problems


def acr_ignore_problems(cfg: LabConfig, root: Path, sent: list[Path]) -> list[str]:
    """The ``.dockerignore`` lines ``az acr build`` reads otherwise than Docker, whose rules
    ``context_files`` follows (azure-cli's acr ``_archive_utils.py``, ``IgnoreRule``):

    - it keeps a leading or trailing '/' in a pattern (it strips them only after '!';
      Azure/azure-cli #20413), so ``data/`` matches no path and the folder is sent;
    - ``**/`` becomes ``.*`` with no '/' after it, so ``**/data`` leaves out every name that
      ends in ``data`` (``mytask/metadata/``), which the image then lacks.
    """
    ignore = root / DOCKERIGNORE
    if not ignore.is_file():
        return []
    where, problems = f"{cfg.key('taskPackage')} {ignore}", []
    lines = [line.strip() for line in ignore.read_text().splitlines()]
    for line in lines:
        if not line or line.startswith(("#", "!")):
            continue
        if line.strip("/") != line:
            problems.append(
                f"{where}: az acr build matches nothing with the line {line!r} (it keeps a "
                f"leading or trailing '/' in the pattern) and sends what it names: write "
                f"{line.strip('/')!r}"
            )
        tail = line.removeprefix("**/")
        if (
            tail != line
            and not any(c in tail for c in "/*?[\\")
            and not any(other.startswith("!") for other in lines)
        ):
            dropped = [p for p in sent if any(n.endswith(tail) and n != tail for n in p.parts)]
            if dropped:
                problems.append(
                    f"{where}: az acr build reads the line {line!r} as any name ending in "
                    f"{tail} and would leave {dropped[0].as_posix()} out of the image: rename "
                    f"it, or list the paths to leave out instead ({tail}, */{tail}, ...)"
                )
    return problems


def context_warnings(cfg: LabConfig, root: Path) -> list[str]:
    """A large context, and requirements without an exact version: built, but said."""
    files = context_files(root, dockerfile="")
    warnings = []
    size = sum(p.stat().st_size for p in files)
    if size > LARGE_CONTEXT_BYTES:
        biggest = max(files, key=lambda p: p.stat().st_size).relative_to(root)
        warnings.append(
            f"{cfg.key('taskPackage')} {root}: the image build sends {size / 2**20:.0f} MiB "
            f"(largest: {biggest}); data belongs in the data container "
            "(python -m lab data upload), other files in .dockerignore"
        )
    requirements = root / REQUIREMENTS
    if requirements.is_file() and requirements in files:
        loose = [
            line.strip()
            for line in requirements.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith(("#", "-")) and not _PINNED.match(line)
        ]
        if loose:
            warnings.append(
                f"{requirements}: {', '.join(loose)} has no exact version (==): a new image "
                "may install another version"
            )
    return warnings


def _script_problems(cfg: LabConfig, root: Path | None) -> list[str]:
    script = cfg.job.script
    if not script or root is None:
        return []
    where = f"{cfg.key('script')} {script}"
    target = root / script
    if not target.is_file():
        return [f"{where}: no such file in {cfg.key('taskPackage')} {root}"]
    if target not in context_files(root, dockerfile=""):
        return [f"{where}: {root / '.dockerignore'} leaves it out of the image"]
    return []


def _source(cfg: LabConfig, root: Path | None) -> TaskSource:
    """The task's source: a built-in task in the image's training/, a reference in the package
    (or in the image's ``training`` package); ConfigError naming task and package."""
    reference = builtin_reference(cfg.task) if cfg.task in TASK_NAMES else cfg.task
    roots = [root] if root and not reference.startswith("training.") else [IMAGE_ROOT]
    try:
        return read_task(reference, roots)
    except TaskSourceError as exc:
        module = reference.partition(":")[0]
        looked = f"{module.replace('.', '/')}.py or {module.replace('.', '/')}/__init__.py"
        place = f"{cfg.key('taskPackage')} {roots[0]}" if root else "the lab's image"
        raise ConfigError(
            [
                f"{cfg.key('task')} {cfg.task} cannot be imported from {place}: {exc} "
                f"(looked for {looked})"
            ]
        ) from None


def resolve(cfg: LabConfig, project_dir: Path) -> tuple[LabConfig, list[str]]:
    """``cfg`` with what its workers run (``cfg.training``), and the warnings to show.

    Raises ConfigError listing every problem of the package, the task and ``trainArgs``.
    """
    root = package_dir(cfg, project_dir)
    if root is not None and not root.is_dir():
        raise ConfigError([f"{cfg.key('taskPackage')} {root} is not a directory"])
    problems = (context_problems(cfg, root) if root else []) + _script_problems(cfg, root)
    if problems:
        raise ConfigError(problems)
    warnings = context_warnings(cfg, root) if root else []
    source = None if cfg.job.script else _source(cfg, root)
    if source is not None and not source.readable:
        warnings.append(
            f"{cfg.key('task')} {cfg.task}: its options cannot be read from its source "
            f"({source.opaque_because}): the workers check {cfg.key('trainArgs')} when they "
            "start, not pulumi up"
        )
    builtin = cfg.task in TASK_NAMES and not is_task_reference(cfg.task)
    run = training_run(cfg, source, builtin, str(root) if root else "")
    return replace(cfg, training=run), warnings
