"""torchrun's elastic agent, run in this process, with workers forked from a warm fork server.

Plain ``torchrun --module training.train`` starts every worker as a new interpreter, so on every
membership change each worker pays again for ``import torch`` and for the first DDP and
optimiser construction (which import ``torch._dynamo``): about 3.5 s of a restart on two CPU
cores. Here the same agent (torch's ``elastic_launch`` with torchrun's own argument parsing:
the same PET_* flags, the same rendezvous, the same restart rules) runs ``training.train`` as a
function, in processes forked from a fork server that did those imports once, when the node
started. A restart then costs a fork.

A fork server and not a plain fork: the agent has threads (the rendezvous keep-alive), and a
threaded process must not fork; the server is single-threaded and never touches CUDA.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import tempfile
from argparse import Namespace
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from training.elastic.exit_codes import BAD_INPUT, VERDICT_ENV
from training.elastic.launch import ETCD_BACKENDS, LAUNCHER_ENV, ROUND_FILE_ENV, TRAIN_MODULE
from training.loop.config import parse_config

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

# What the fork server imports once; every worker forked from it starts with these loaded.
PRELOAD = ("torch", "torch._dynamo", "torch.nn.parallel", TRAIN_MODULE)


def worker(*argv: str) -> None:
    """One worker: ``training.train`` with ``argv``; a non-zero exit code fails the worker.

    Bad input found after joining (a checkpoint of another run, say) is the same in every
    round: the verdict file stops the agent before it spends another restart on it.
    """
    from training.train import run

    code = run(list(argv))
    if code == BAD_INPUT and (verdict := os.environ.get(VERDICT_ENV)):
        Path(verdict).write_text("see the worker's log for the setting and the fix")
    if code:
        raise SystemExit(code)


class LauncherError(ValueError):
    """The warm launcher cannot run here (a broken image, a torch it was not written for): no
    restart fixes it, and ``TRAIN_LAUNCHER=torchrun`` still can."""


def _preloaded(conn: Connection, names: list[str]) -> None:
    """In a process forked from the server: report the preloads it does not hold.

    Python's fork server swallows an ImportError of a preload (``multiprocessing.forkserver``,
    ``main``) and forks cold workers from then on; a module missing here is imported again
    for its error.
    """
    missing = {}
    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
                missing[name] = "not imported by the fork server"
            except Exception as exc:  # noqa: BLE001 - reported to the agent, which stops
                missing[name] = f"{type(exc).__name__}: {exc}"
    conn.send(missing)
    conn.close()


def start_fork_server() -> None:
    """Start the fork server; its imports run while this process goes on."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()


def wait_until_warm() -> None:
    """Block until the fork server holds every preloaded module (a process forked from it
    says so); LauncherError naming the module and its error otherwise.

    The node joins the rendezvous only then: a node that joined cold would keep the others'
    warm workers waiting for its imports inside process-group init, which the short collective
    timeout bounds.
    """
    ctx = multiprocessing.get_context("forkserver")
    ours, theirs = ctx.Pipe(duplex=False)
    probe = ctx.Process(target=_preloaded, args=(theirs, list(PRELOAD)), name="warm-up")
    probe.start()
    theirs.close()
    try:
        missing = ours.recv()
    except EOFError:  # it died before it could say
        missing = None
    probe.join()
    if missing is None or probe.exitcode != 0:
        raise LauncherError(f"the fork server could not start a process (exit {probe.exitcode})")
    if missing:
        raise LauncherError(
            "the fork server could not import "
            + "; ".join(f"{name} ({why})" for name, why in missing.items())
            + f". Fix the image, or set {LAUNCHER_ENV}=torchrun to start workers without it."
        )


WORKER_IDENTICAL_ENV = "TORCH_ELASTIC_WORKER_IDENTICAL"
"""With it set, torch's agent gives each worker its rank without a store exchange (the fast
path ``SimpleElasticAgent._assign_worker_ranks`` documents): every node runs the same number
of workers (the PyTorchJob's one ``nprocPerNode``), and no agent waits in the store for a
member that died right after its round completed (up to the store's 300 s)."""


def torchrun_config(args: Sequence[str]) -> tuple[Namespace, LaunchConfig]:
    """torchrun's own parsing of ``args`` (its flags, the PET_* env) into a ``LaunchConfig``.

    Through the two functions torchrun's ``main`` calls, ``torch.distributed.run.parse_args``
    and ``config_from_args``, which torch does not document (written against torch 2.13). A
    torch that changed them stops the node here with the fallback named, instead of starting
    an agent on a config it misread.
    """
    from torch.distributed.launcher.api import LaunchConfig

    try:
        from torch.distributed.run import config_from_args, parse_args

        parsed = parse_args(list(args))
        _ = (parsed.module, parsed.training_script, parsed.training_script_args)
        config = config_from_args(parsed)[0]
        if not isinstance(config, LaunchConfig):
            raise TypeError(f"config_from_args returned {type(config).__name__}")
    except (ImportError, AttributeError, TypeError, LookupError) as exc:
        import torch

        raise LauncherError(
            f"torch {torch.__version__} changed torch.distributed.run.parse_args or "
            f"config_from_args, which the warm launcher reuses for torchrun's flags ({exc}); "
            f"set {LAUNCHER_ENV}=torchrun to run torchrun itself"
        ) from exc
    return parsed, config


def launch(args: Sequence[str]) -> None:
    """``torchrun ARGS`` for ``--module training.train ...``, its workers forked warm."""
    # Before the fork server starts: its workers inherit the environment it starts with.
    verdict = Path(tempfile.gettempdir()) / f"spot-lab-verdict-{os.getpid()}"
    verdict.unlink(missing_ok=True)
    os.environ[VERDICT_ENV] = str(verdict)
    os.environ[ROUND_FILE_ENV] = str(verdict.with_name(f"spot-lab-round-{os.getpid()}"))
    os.environ[WORKER_IDENTICAL_ENV] = "1"
    start_fork_server()  # first, so that its imports and the ones below overlap
    # torch's log formatter imports torch._dynamo to format a logged exception, and the agent
    # logs one on every worker failure: imported now, that is not 2-3 s of the first recovery.
    import torch._dynamo  # noqa: F401
    from torch.distributed.launcher.api import elastic_launch

    parsed, config = torchrun_config(args)
    if not parsed.module or parsed.training_script != TRAIN_MODULE:
        raise ValueError(
            f"the warm launcher runs --module {TRAIN_MODULE} only, got "
            f"{parsed.training_script!r}; set {LAUNCHER_ENV}=torchrun for anything else"
        )
    # Every worker parses the same flags and env: a mistake there is the same on every rank
    # and no restart fixes it, so the node stops here (a ConfigError), before it joins.
    from training.data.cifar10 import DatasetError, dataset_files

    cfg = parse_config(parsed.training_script_args)
    # Missing data fails every worker the same way, restart after restart: stop before joining.
    try:
        dataset_files(cfg.data.data_dir)
    except DatasetError as exc:
        raise ValueError(str(exc)) from None
    config.start_method = "forkserver"
    if config.rdzv_backend not in ETCD_BACKENDS:
        raise ValueError(
            f"the warm launcher runs the etcd rendezvous ({', '.join(ETCD_BACKENDS)}), got "
            f"{config.rdzv_backend!r}; set {LAUNCHER_ENV}=torchrun for anything else"
        )
    # The operator can only name torch's backends (its CRD's enum): the same etcd, our
    # handler (training/elastic/rendezvous.py), registered through torch's public registry.
    from training.elastic.rendezvous import register

    config.rdzv_backend = register()
    wait_until_warm()
    elastic_launch(config=config, entrypoint=worker)(*parsed.training_script_args)
