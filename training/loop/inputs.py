"""What a worker checks before its first collective: config, data and checkpoint stores.

A mistake here is the same on every rank and no restart fixes it, so it ends the worker with
an error that names the setting (exit 2) before any rank waits on another. One exception: a
checkpoint store that fails in a later round of the run answered before, so it is down for a
while, not misconfigured; the worker tries it again, then leaves the round to be restarted.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from training.api import Data, Samples, Stream, TaskContractError, is_stream
from training.checkpoints.checkpoint import CheckpointError, CheckpointRepository
from training.checkpoints.deadline import NOT_TRANSIENT, Deadline, retrying
from training.checkpoints.lineage import store_lineage
from training.checkpoints.node_local import NodeLocalState, node_local_key, uri_digest
from training.checkpoints.storage import ObjectStore
from training.checkpoints.stores import open_store
from training.data.cifar10 import DatasetError
from training.loop.config import ConfigError, TrainConfig, check_batch_fits, parse_config
from training.loop.dist import DistEnv
from training.loop.run_changes import check_init_from, state_option_names
from training.loop.task_checks import check_data

STORE_RETRY_S = 20.0
"""How long a worker of a later round keeps trying a failing checkpoint store before it ends
the round (exit 75): below the cluster's 30 s collective timeout, so its peers wait for it."""


class StoreUnavailable(OSError):
    """The checkpoint store, which answered earlier in this run, still fails: restart later."""


# Not compared when resuming from a durable checkpoint, which may be moved to another URI
# (a Blob CSI mount and the https URL of the same container); it only keys node-local saves.
STORAGE_KEY = "checkpoint_uri_sha256"


def run_identity(cfg: TrainConfig, dataset: Samples | Stream) -> dict[str, Any]:
    """What a saved state must match to be resumed: what changes the meaning of that state.

    The task and its options that shape the parameters (``TrainSpec.state_options``; all of
    them when it does not say), the dtype (a float64 state is not resumed in float32), the
    precision (fp16's state holds its gradient scaler's; a resume repeats the trajectory only
    in the precision it was computed in: another one is a new run, ``--init-from``), the
    dataset's content and the data order a step stands for (the seed, the global batch):
    resuming over another of these would go on silently from a trajectory this run never had.
    The learning rate and the other options may change (training/loop/run_changes.py).
    float32, fp32 and the cifar task, the defaults, are not named, so the states written before
    those settings existed still match.
    """
    state_options = state_option_names(cfg)
    identity: dict[str, Any] = {
        "global_batch_size": cfg.optim.global_batch_size,
        "seed": cfg.run.seed,
        **{k: v for k, v in asdict(cfg.options).items() if k in state_options},
        **_dataset_identity(dataset),
        STORAGE_KEY: uri_digest(cfg.checkpoint.checkpoint_uri),
    }
    if cfg.run.task != "cifar":
        identity["task"] = cfg.run.task
    if cfg.run.dtype != "float32":
        identity["dtype"] = cfg.run.dtype
    if cfg.run.precision != "fp32":
        identity["precision"] = cfg.run.precision
    return identity


def _dataset_identity(dataset: Samples | Stream) -> dict[str, Any]:
    """Indexable samples: their count and content digest. A stream: its identity (a name and
    a version, or a manifest's digest), since hashing a streamed corpus means reading it all."""
    if is_stream(dataset):
        return {"dataset": dataset.identity}  # type: ignore[union-attr]
    return {"num_samples": len(dataset), "dataset_sha256": dataset.digest}  # type: ignore[arg-type,union-attr]


def open_durable(
    cfg: TrainConfig, retry_s: float = 0.0, read_head: bool = True
) -> tuple[CheckpointRepository, str]:
    """The durable checkpoints and their lineage id (created in a new or emptied store), read
    once here so a bad store fails before any collective. ``read_head`` False: the lineage
    only (the agent's commit after its SIGTERM reads the manifests in the commit itself).

    ``retry_s`` > 0 (a later round, an eviction's commit): a store that fails is tried again
    for that long, then StoreUnavailable. Otherwise, or for an error no retry fixes,
    ConfigError at once.
    """
    uri = cfg.checkpoint.checkpoint_uri

    def attempt() -> tuple[CheckpointRepository, str]:
        durable = CheckpointRepository(open_store(uri), keep=cfg.checkpoint.checkpoint_keep)
        if read_head:
            durable.head()
        return durable, store_lineage(durable.store, durable.prefix)

    try:
        if not retry_s:
            return attempt()
        return retrying(Deadline.after(retry_s), attempt, "reading the checkpoint store")
    except (ValueError, CheckpointError, *NOT_TRANSIENT) as exc:
        raise _unreadable(uri, exc) from exc
    except OSError as exc:  # a timeout, a refused connection, a 5xx
        if not retry_s:
            raise _unreadable(uri, exc) from exc
        raise StoreUnavailable(
            f"--checkpoint-uri (or TRAIN_CHECKPOINT_URI) {uri}: the checkpoint store, which "
            f"answered earlier in this run, still fails after {retry_s:g} s: {exc}; the round "
            f"is restarted"
        ) from exc


def _unreadable(uri: str, exc: Exception) -> ConfigError:
    return ConfigError(
        f"--checkpoint-uri (or TRAIN_CHECKPOINT_URI) {uri}: cannot read the checkpoint store: {exc}"
    )


def open_node_local(
    cfg: TrainConfig, env: DistEnv, dataset: Samples | Stream, lineage: str
) -> NodeLocalState:
    """This job's emergency saves on this node, keyed by run id, checkpoint URI and the
    durable store's lineage (a store emptied since is a new history)."""
    key = node_local_key(env.run_id, cfg.checkpoint.checkpoint_uri, lineage)
    try:
        return NodeLocalState(
            cfg.checkpoint.local_dir, key, expected_run=run_identity(cfg, dataset)
        )
    except OSError as exc:
        raise ConfigError(
            f"--local-dir (or TRAIN_LOCAL_DIR) {cfg.checkpoint.local_dir}: cannot create the "
            f"node-local checkpoint directory: {exc}"
        ) from exc


def load_data(cfg: TrainConfig) -> Data:
    """The task's data from ``--data-dir``; DatasetError naming the setting when unreadable."""
    where = f"--data-dir (or TRAIN_DATA_DIR) {cfg.data.data_dir}"
    try:
        data = cfg.spec.load_data(cfg.data.data_dir, cfg.options)
    except OSError as exc:
        raise DatasetError(f"{where}: cannot read it: {exc}") from exc
    except ValueError as exc:
        raise DatasetError(f"{where}: {exc}") from exc
    try:
        check_data(cfg.run.task, data)
    except TaskContractError as exc:
        raise ConfigError(str(exc)) from None
    return data


def load_inputs(
    argv: list[str] | None, env: DistEnv
) -> tuple[TrainConfig, Data, ObjectStore, NodeLocalState]:
    """Config, data and checkpoint stores, all checked before any collective.

    Raises ConfigError or DatasetError, naming the setting, on what a restart cannot fix;
    StoreUnavailable when the store failed in a later round (the restart count or the round
    says the run got past its first start) and kept failing for ``STORE_RETRY_S``.
    """
    cfg = parse_config(argv)
    data = load_data(cfg)
    train = data.train
    check_batch_fits(cfg, None if is_stream(train) else len(train), env.world_size)  # type: ignore[arg-type]
    later = env.restart_count > 0 or env.rdzv_round > 1
    durable, lineage = open_durable(cfg, STORE_RETRY_S if later else 0.0)
    check_init_from(cfg)
    return cfg, data, durable.store, open_node_local(cfg, env, data.train, lineage)
