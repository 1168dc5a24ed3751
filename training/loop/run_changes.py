"""What may change between a run's saved state and its resume, and a start from another run.

The run's identity (training/loop/inputs.py ``run_identity``) holds what changes the meaning
of the saved state: the task, the parameters' shapes (the task's ``state_options``), the data
and its order. Everything else a resume may change: the learning rate, a schedule's length,
dropout, weight decay. The state keeps the values it was trained with (``settings``), so a
resume under other values logs each change, old and new, and applies it from the next step:

- the optimizer's hyperparameters as the task built them now replace the saved ones that
  differ (a saved optimizer brings back the old ones);
- a changed base learning rate scales each group's current rate, and the scheduler's bases;
  a ``LambdaLR`` (a schedule as a function of the step) recomputes the rate at its step, so a
  changed schedule's length holds from the next step too. Another scheduler takes a changed
  schedule from its own next step.

``--init-from URI`` starts a new run from another run's newest verified checkpoint: its
model's weights, a fresh optimizer and step 0, from its DCP checkpoint, each rank reading only
its own shards (a DDP replica: all of it).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.checkpoints.checkpoint import CheckpointError, CheckpointRepository
from training.checkpoints.sharded.initial import DoesNotFit, load_sharded_source
from training.checkpoints.sharded.repository import PREFIX as SHARDED_PREFIX
from training.checkpoints.stores import open_store
from training.loop.config import ConfigError, TrainConfig

INIT_FROM = "--init-from (or TRAIN_INIT_FROM)"
_SKIPPED = ("params", "lr", "initial_lr")


def state_option_names(cfg: TrainConfig) -> set[str]:
    """The task's options that are part of the run's identity (all, unless it says which)."""
    declared = cfg.spec.state_options
    return {f.name for f in fields(cfg.options)} if declared is None else set(declared)


def changeable_values(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resume may change: ``lr`` and the task's other options."""
    state = state_option_names(cfg)
    options = {k: v for k, v in asdict(cfg.options).items() if k not in state}
    return {"lr": cfg.optim.lr, **options}


def built_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters as built: its base rate (a scheduler's
    ``initial_lr``), and the plain values (weight decay, momentum, betas)."""
    return [
        {
            "base_lr": float(group.get("initial_lr", group["lr"])),
            **{
                k: v
                for k, v in group.items()
                if k not in _SKIPPED and isinstance(v, bool | int | float | str | tuple)
            },
        }
        for group in optimizer.param_groups
    ]


def settings(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a state records of the changeable settings (read before any step)."""
    return {"values": changeable_values(cfg), "param_groups": built_groups(optimizer)}


def saved_settings(
    state: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any]
) -> dict[str, Any]:
    """The settings a state was trained with. An option it holds no value for did not exist
    yet: it was trained at its default. A state written before the settings were recorded
    holds them in its identity (``run``), and its groups' bases follow from its ``lr``."""
    recorded = state.get("settings") or {"values": state["run"], "param_groups": None}
    values = {
        k: recorded["values"].get(k, defaults.get(k))
        for k in current["values"]
        if k in recorded["values"] or k in defaults
    }
    groups = recorded["param_groups"]
    if groups is None:
        ratio = float(values.get("lr", current["values"]["lr"])) / current["values"]["lr"]
        groups = [{**g, "base_lr": g["base_lr"] * ratio} for g in current["param_groups"]]
    return {"values": values, "param_groups": groups}


def changed_values(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: {"old": ..., "new": ...}}`` for each setting the resume changes."""
    old, new = saved["values"], current["values"]
    return {k: {"old": old[k], "new": v} for k, v in new.items() if k in old and old[k] != v}


def apply_changes(
    saved: dict[str, Any],
    current: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
    """Bring the restored optimizer and scheduler to ``current``'s settings (module doc);
    touches nothing when nothing changed."""
    if saved == current:
        return
    pairs = zip(optimizer.param_groups, saved["param_groups"], current["param_groups"], strict=True)
    for i, (group, old, new) in enumerate(pairs):
        if old["base_lr"] != new["base_lr"]:
            group["lr"] = group["lr"] * new["base_lr"] / old["base_lr"]
            if "initial_lr" in group:
                group["initial_lr"] = new["base_lr"]
            if scheduler is not None:
                scheduler.base_lrs[i] = new["base_lr"]
        for key, value in new.items():
            if key != "base_lr" and old.get(key) != value:
                group[key] = value
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        for i, group in enumerate(optimizer.param_groups):
            group["lr"] = scheduler.base_lrs[i] * scheduler.lr_lambdas[i](scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def check_init_from(cfg: TrainConfig) -> None:
    """ConfigError naming ``--init-from`` when its store is unreadable or holds no checkpoint
    this run can start from: before any collective, as every other input."""
    uri = cfg.checkpoint.init_from
    if not uri:
        return
    try:
        head = CheckpointRepository(open_store(uri), prefix=SHARDED_PREFIX).head()
    except (ValueError, OSError, CheckpointError) as exc:
        raise ConfigError(f"{INIT_FROM} {uri}: cannot read the checkpoint store: {exc}") from exc
    if head is None:
        raise ConfigError(
            f"{INIT_FROM} {uri}: no checkpoint there to start from (give another run's "
            "--checkpoint-uri, once it committed a step)"
        )


def load_initial_shards(uri: str, model: nn.Module, scratch: Path, group: Any) -> int:
    """The model's weights from the newest verified checkpoint at ``uri``, each rank reading
    only its shards (a DDP replica: all of it; training/checkpoints/sharded/initial.py); its
    step. Every rank calls this. ConfigError when there is none or its model does not fit."""
    try:
        entry = load_sharded_source(open_store(uri), scratch, model, group)
    except (ValueError, OSError, CheckpointError) as exc:
        if isinstance(exc, DoesNotFit):
            raise ConfigError(
                f"{INIT_FROM} {uri}: its model does not fit this task's ({exc})"
            ) from None
        raise ConfigError(f"{INIT_FROM} {uri}: cannot read the checkpoint store: {exc}") from exc
    if entry is None:
        raise ConfigError(f"{INIT_FROM} {uri}: no verified checkpoint there to start from")
    return entry.step
