"""``python -m training.train``: one worker. Run under ``torchrun`` (any rendezvous backend), the
warm launcher (training/launcher.py) or plain python.

Inputs checked before the first collective, the process group, then the Trainer
(training/loop/trainer.py); the exit code says how it ended (training/elastic/exit_codes.py).
"""

from __future__ import annotations

import logging
import sys
import time

import torch.distributed as dist

from training.api import Data, TaskContractError
from training.checkpoints.checkpoint import CheckpointError
from training.checkpoints.node_local import NodeLocalState
from training.checkpoints.storage import ObjectStore
from training.data.cifar10 import DatasetError
from training.elastic.exit_codes import BAD_INPUT, DEVICE_FAULT, LOCAL_ERROR, OK, WORKER_RESTART
from training.elastic.faults import (
    StopRequest,
    every_rank_raised,
    is_device_fault,
    is_peer_failure,
)
from training.elastic.permit import watch_pauses
from training.loop.config import ConfigError, TrainConfig
from training.loop.determinism import use_deterministic_algorithms
from training.loop.dist import (
    DistEnv,
    destroy_process_group,
    device_for,
    init_process_group,
    new_checkpoint_group,
)
from training.loop.inputs import StoreUnavailable, load_inputs
from training.loop.metrics import EventLog, Phases, setup_logging
from training.loop.run_records import open_records
from training.loop.step_guard import StepGuard
from training.loop.trainer import Trainer
from training.loop.trainer_state import exit_now

logger = logging.getLogger("training")


def _checkpoint_group(cfg: TrainConfig, env: DistEnv) -> dist.ProcessGroup:
    started = time.monotonic()
    group = new_checkpoint_group(cfg.checkpoint.restore_timeout_s)
    seconds = round(time.monotonic() - started, 4)
    if env.rank == 0:  # one store round-trip and a gloo mesh: small, but measured
        logger.info("checkpoint group (gloo) created in %.4f s", seconds)
    return group


def _not_the_jobs(exc: Exception, group: dist.ProcessGroup) -> int:
    """The code of an exception the loop does not survive, when it is not the job's; raised
    again when it is (every rank raised it: a bug no restart fixes, the worker exits 1).

    A fault of this node's GPU makes the node leave; an error no other rank raised is this
    rank's (its peers were still training), which a restart may not meet.
    """
    if is_device_fault(exc):
        logger.error(
            "a fault of this node's GPU: %s. Exiting %d: the node leaves, for a new pod",
            str(exc).splitlines()[0],
            DEVICE_FAULT,
        )
        return DEVICE_FAULT
    if every_rank_raised(exc, group):
        raise exc
    logger.exception("an error no other rank raised: exiting %d for a restart", LOCAL_ERROR)
    return LOCAL_ERROR


def run(argv: list[str] | None = None) -> int:
    """Train with ``argv``; the exit code. Under torchrun the process group is left to exit."""
    phases = Phases()
    env = DistEnv.from_env()
    setup_logging(env)
    events = EventLog(env)
    # Under torchrun a SIGTERM acts at once, even mid-collective; nothing to save until the
    # trainer restored its state, so until then it only ends the process.
    stop = StopRequest(act_at_once=env.launched)

    def stop_before_training() -> None:
        events.close()  # the run's records so far (its sink, once open)
        exit_now(WORKER_RESTART)

    stop.until_then(stop_before_training)
    watch_pauses()  # from here, not from the first step: a pause while restoring counts
    try:
        cfg, data, store, local = load_inputs(argv, env)
    except (ConfigError, DatasetError) as exc:
        logger.error("%s", exc)
        return BAD_INPUT
    except StoreUnavailable as exc:
        logger.error("%s", exc)
        return WORKER_RESTART
    phases.mark("inputs")
    events.sink = open_records(cfg.checkpoint.records_uri, cfg.checkpoint.checkpoint_uri)
    try:
        return _run(cfg, env, data, store, local, events, stop, phases)
    finally:
        events.close()  # the run's records, stored before the process goes


def _run(
    cfg: TrainConfig,
    env: DistEnv,
    data: Data,
    store: ObjectStore,
    local: NodeLocalState,
    events: EventLog,
    stop: StopRequest,
    phases: Phases,
) -> int:
    """The rest of ``run``, once its inputs are checked."""
    logger.info("config %s", cfg.as_dict())
    if cfg.run.deterministic:  # before the device: cuBLAS reads its setting as CUDA starts
        logger.info("deterministic mode: %s", use_deterministic_algorithms())
    # The run's target, so a report built from the logs alone knows what "finished" means.
    events.event(
        "started",
        world_size=env.world_size,
        local_rank=env.local_rank,
        group_rank=env.group_rank,
        max_steps=cfg.run.max_steps,
        task=cfg.run.task,
        global_batch_size=cfg.optim.global_batch_size,
    )
    device = device_for(env)
    try:
        init_process_group(env, device, cfg.run.collective_timeout_s)
        group = _checkpoint_group(cfg, env)
        guard = StepGuard.create(dist.get_backend(), cfg.run.collective_timeout_s)
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        # A peer vanished while the group formed (its store timed out waiting for it): a lost
        # peer, like one in a collective, not a bug. Nothing was trained in this round.
        logger.warning("a peer left while the process group formed: %s", exc)
        return WORKER_RESTART
    phases.mark("process_group")
    code = OK
    try:
        trainer = Trainer(cfg, env, device, data, store, local, events, group, guard)
        stop.on_stop(lambda: trainer.stop_now(stop))
        phases.mark("build")
        code = trainer.run(stop, phases)
    except (ConfigError, TaskContractError) as exc:
        logger.error("%s", exc)
        code = BAD_INPUT
    except CheckpointError as exc:  # e.g. the store unreadable from every rank: retry later
        logger.error("%s", exc)
        code = WORKER_RESTART
    except Exception as exc:
        code = _not_the_jobs(exc, group)  # raised again when every rank raised it
    finally:
        if not env.launched:
            destroy_process_group()
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m training.train`` (torchrun's workers, or a single process)."""
    code = run(argv)
    if DistEnv.from_env().launched and dist.is_initialized():
        # Skip gloo's teardown under torchrun: it aborts ("terminate called without an active
        # exception") when a peer is dead, or when rank 0, which hosts the workers' store,
        # has already exited. All state is saved by now; the exit code is what counts.
        exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
