"""torchrun's elastic agent, run in this process, with workers forked from a warm fork server.

Plain ``torchrun --module training.train`` starts every worker as a new interpreter, so on every
membership change each worker pays again for ``import torch`` and for the first DDP and
optimiser construction (which import ``torch._dynamo``): about 3.5 s of a restart on two CPU
cores. Here the same agent (torch's ``LocalElasticAgent``, configured by torchrun's own
argument parsing: the same PET_* flags, the same rendezvous, the same restart rules) runs
``training.train`` as a function, in processes forked from a fork server that did those imports
once, when the node started. A restart then costs a fork.

A fork server and not a plain fork: the agent has threads (the rendezvous keep-alive), and a
threaded process must not fork; the server is single-threaded and never touches CUDA.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from training.elastic.exit_codes import BAD_INPUT, DEVICE_FAULT, DEVICE_FAULT_ENV, VERDICT_ENV
from training.elastic.faults import AGENT_SIGNALLED_ENV
from training.elastic.launch import ETCD_BACKENDS, LAUNCHER_ENV, ROUND_FILE_ENV, TRAIN_MODULE
from training.elastic.permit import PERMIT_FILE_ENV
from training.loop.config import parse_config

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

    from training.elastic.liveness import Progress
    from training.elastic.rendezvous import SpotRendezvousHandler

logger = logging.getLogger(__name__)

# What the fork server imports once; every worker forked from it starts with these loaded.
# The first makes the server outlive a SIGTERM to every process of the node (an OS shutdown).
PRELOAD = ("training.fork_server", "torch", "torch._dynamo", "torch.nn.parallel", TRAIN_MODULE)


def worker(*argv: str) -> None:
    """One worker: ``training.train`` with ``argv``; a non-zero exit code fails the worker.

    Bad input found after joining (a checkpoint of another run, say) is the same in every
    round: the verdict file stops the agent before it spends another restart on it. A fault
    of this node's GPU is the same on every restart here: its file makes the agent leave.
    """
    from training.loop.trainer_state import wait_for_stop
    from training.train import run

    code = run(list(argv))
    # The loop can return while the SIGTERM thread still saves (the loop's own wait for that
    # save ends at the deadline); multiprocessing would end the process under it.
    wait_for_stop()
    if code == BAD_INPUT and (verdict := os.environ.get(VERDICT_ENV)):
        Path(verdict).write_text("see the worker's log for the setting and the fix")
    if code == DEVICE_FAULT and (fault := os.environ.get(DEVICE_FAULT_ENV)):
        Path(fault).write_text(f"local rank {os.environ.get('LOCAL_RANK', '0')}")
    if code:
        raise SystemExit(code)


class DeviceFault(Exception):
    """A worker of this node met a fault of its GPU: the node leaves the rendezvous at once,
    for a new pod, instead of restarting its workers on the same device."""


def raise_if_device_failed() -> None:
    """DeviceFault when a worker of this node wrote the device-fault file (``worker``)."""
    fault = os.environ.get(DEVICE_FAULT_ENV)
    if fault and Path(fault).exists():
        raise DeviceFault(f"a worker's GPU failed ({Path(fault).read_text()}; see its log)")


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


def launch(args: Sequence[str], handlers: list[SpotRendezvousHandler] | None = None) -> None:
    """``torchrun ARGS`` for ``--module training.train ...``, its workers forked warm; the
    rendezvous handler it makes goes into ``handlers``, for the agent's endings."""
    # Before the fork server starts: its workers inherit the environment it starts with.
    verdict = Path(tempfile.gettempdir()) / f"spot-lab-verdict-{os.getpid()}"
    verdict.unlink(missing_ok=True)
    os.environ[VERDICT_ENV] = str(verdict)
    os.environ[ROUND_FILE_ENV] = str(verdict.with_name(f"spot-lab-round-{os.getpid()}"))
    permit = verdict.with_name(f"spot-lab-permit-{os.getpid()}")
    permit.unlink(missing_ok=True)  # the rendezvous handler makes it, lapsed
    os.environ[PERMIT_FILE_ENV] = str(permit)
    fault = verdict.with_name(f"spot-lab-device-fault-{os.getpid()}")
    fault.unlink(missing_ok=True)
    os.environ[DEVICE_FAULT_ENV] = str(fault)
    signalled = verdict.with_name(f"spot-lab-agent-signalled-{os.getpid()}")
    signalled.unlink(missing_ok=True)
    os.environ[AGENT_SIGNALLED_ENV] = str(signalled)
    os.environ[WORKER_IDENTICAL_ENV] = "1"
    start_fork_server()  # first, so that its imports and the ones below overlap
    # torch's log formatter imports torch._dynamo to format a logged exception, and the agent
    # logs one on every worker failure: imported now, that is not 2-3 s of the first recovery.
    import torch._dynamo  # noqa: F401

    STOP.install()
    parsed, config = torchrun_config(args)
    if not parsed.module or parsed.training_script != TRAIN_MODULE:
        raise ValueError(
            f"the warm launcher runs --module {TRAIN_MODULE} only, got "
            f"{parsed.training_script!r}; set {LAUNCHER_ENV}=torchrun for anything else"
        )
    # Every worker parses the same flags and env: a mistake there is the same on every rank
    # and no restart fixes it, so the node stops here (a ConfigError), before it joins.
    from training.data.cifar10 import DatasetError
    from training.loop.inputs import load_data

    cfg = parse_config(parsed.training_script_args)
    STOP.deadline_s = cfg.checkpoint.stop_deadline_s
    # Missing data fails every worker the same way, restart after restart: stop before joining.
    # The task reads it as its workers will (once per pod; the workers read it again).
    try:
        load_data(cfg)
    except DatasetError as exc:
        raise ValueError(str(exc)) from None
    config.start_method = "forkserver"
    if config.rdzv_backend not in ETCD_BACKENDS:
        raise ValueError(
            f"the warm launcher runs the etcd rendezvous ({', '.join(ETCD_BACKENDS)}), got "
            f"{config.rdzv_backend!r}; set {LAUNCHER_ENV}=torchrun for anything else"
        )
    # The operator can only name torch's backends (c10d, etcd, etcd-v2): etcd, served by our
    # handler (training/elastic/rendezvous.py), registered through torch's public registry.
    from training.elastic.rendezvous import register

    config.rdzv_backend = register()
    wait_until_warm()
    run_agent(config, parsed.training_script_args, handlers)


EXIT_BARRIER_TIMEOUT_S = 10.0
"""How long a node whose workers finished waits for the other agents (torch's default: 300 s).
Nothing here needs them: the workers' own final barrier ends every rank together, and the
store is etcd, not an agent. With torch's default, a peer that died after finishing held every
other node 300 s."""


class AgentStop:
    """When this agent got its SIGTERM: what it still does before it exits (commit the node's
    save: training/agent.py) runs under the eviction's deadline from that moment.

    The handler raises torch's public ``SignalException``, as torch's own does, so the agent
    stops its workers the same way; torch is told not to install its own for SIGTERM (it
    would, at every worker start). It raises wherever the signal lands, and Python drops an
    exception raised in a finalizer (torch closing a worker's handles as it starts the next
    group: chaos seed 147). So the stop is kept and raised again where the agent polls
    (``raise_if_stopped``, called by the rendezvous handler), or it would form a new group
    and train on until the kubelet's SIGKILL.

    Once the agent's work is done (``hold``), a SIGTERM is only recorded: raised in what the
    node still does (leaving the rendezvous, logging its ending), it would replace that ending
    with an exception, and the process would exit 1, which fails the job.
    """

    def __init__(self) -> None:
        self.at: float | None = None
        self.signum: int | None = None
        self.held = False
        self.deadline_s = 0.0
        """``--stop-deadline-s``: what the node does after its SIGTERM ends by then."""
        self.progress: Progress | None = None
        """The rendezvous' progress, held from the SIGTERM to its deadline: the workers' saves
        and the agent's commit beat nothing, and the next round waits for them (a commit past
        the stall timeout looked like a wedged agent, and that round went on without it)."""

    def install(self) -> None:
        self.held = False
        signal.signal(signal.SIGTERM, self._handle)
        # A blocked signal stays blocked across exec: a parent that blocked SIGTERM (a
        # process with a sigwait thread) would leave this agent deaf to its eviction.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    def hold(self) -> None:
        """From now on a SIGTERM is recorded, not raised: the agent's work is done."""
        self.held = True

    def _handle(self, signum: int, frame: object) -> None:
        if self.at is None:
            self.at = time.monotonic()
            if self.progress is not None:
                self.progress.hold(self.at + self.deadline_s)
            # Before torch stops the workers with a SIGTERM of its own: theirs then asks for
            # a durable commit (training/elastic/faults.py, ``sigterm_from_outside``).
            if signalled := os.environ.get(AGENT_SIGNALLED_ENV):
                Path(signalled).touch()
        self.signum = signum
        if not self.held:
            self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        if self.signum is None:
            return
        from torch.distributed.elastic.multiprocessing import SignalException

        sigval = signal.Signals(self.signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


STOP = AgentStop()


def run_agent(
    config: LaunchConfig, args: Sequence[str], handlers: list[SpotRendezvousHandler] | None = None
) -> None:
    """torch's ``launch_agent`` for our entry point, with the exit barrier bounded.

    ``exit_barrier_timeout`` is a parameter of torch's public ``LocalElasticAgent``
    (torch/distributed/elastic/agent/server/api.py, 2.13: ``_exit_barrier``) that
    ``launch_agent`` does not pass on, so the agent is built here from public parts.
    """
    from torch.distributed.elastic.agent.server import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    from training.elastic.rendezvous import SpotRendezvousHandler

    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    signals = [s for s in config.signals_to_handle.split(",") if s.strip() != "SIGTERM"]
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(signals)  # SIGTERM: AgentStop
    rdzv_handler = rendezvous_handler_registry.create_handler(params)
    if isinstance(rdzv_handler, SpotRendezvousHandler):
        # Polled between rounds and by the monitor loop: a stop, or a GPU that failed, ends
        # the agent there, before it starts workers on this node again.
        def check_stop() -> None:
            STOP.raise_if_stopped()
            raise_if_device_failed()

        rdzv_handler.check_stop = check_stop
        STOP.progress = rdzv_handler.progress
        if handlers is not None:
            handlers.append(rdzv_handler)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=worker,
        args=tuple(args),
        rdzv_handler=rdzv_handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    # None is torchrun's "not given": the agent's own default (30 s) then applies.
    shutdown = (
        {} if config.shutdown_timeout is None else {"shutdown_timeout": config.shutdown_timeout}
    )
    # What torch's launch_agent logs first: where the workers' logs go, among the rest.
    logger.info(
        "starting the agent: %s, nodes %s-%s, %s per node, run_id %s, rdzv %s at %s, "
        "max_restarts %s\n  log_dir                  : %s",
        TRAIN_MODULE,
        config.min_nodes,
        config.max_nodes,
        config.nproc_per_node,
        config.run_id,
        config.rdzv_backend,
        config.rdzv_endpoint,
        config.max_restarts,
        config.logs_specs.root_log_dir,  # type: ignore[union-attr]
    )
    agent = LocalElasticAgent(
        spec=spec,
        logs_specs=config.logs_specs,  # type: ignore[arg-type]
        start_method=config.start_method,
        exit_barrier_timeout=EXIT_BARRIER_TIMEOUT_S,
        log_line_prefix_template=config.log_line_prefix_template,
        **shutdown,
    )
    result = agent.run()
    if result is None:
        # torch's run() logs a RendezvousGracefulExitError and returns None (2.13,
        # agent/server/api.py, ``run``): this node left the rendezvous, its peers took it for
        # gone, and it must not run on as if its workers had finished.
        from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

        raise RendezvousGracefulExitError(f"the agent of {TRAIN_MODULE} left the rendezvous")
    if result.is_failed():
        raise ChildFailedError(name=TRAIN_MODULE, failures=result.failures)
