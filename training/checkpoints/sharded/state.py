"""What a sharded checkpoint holds, as DCP ``Stateful`` objects: the model and optimizer through
``torch.distributed.checkpoint.state_dict``, and the trainer's own state.

``get_state_dict``/``set_state_dict`` (torch 2.13 ``checkpoint/state_dict.py``) hand DCP the
model and optimizer keyed by parameter name, unwrapped from DDP and, with FSDP2, as DTensors of
this rank's shards: DCP saves each rank's shards and reshards on load, so a checkpoint saved at
world N loads at world M. Replicated tensors (DDP) are written once, by one rank.

The trainer's state is small and the same on every rank (the step, the samples consumed, the
scheduler), except torch's RNG streams: those of the coordinator are saved
(``CoordinatorSavePlanner``) and restored on every rank, as the single-file path restores the
holder's. A task's extras (an EMA, a GradScaler) are ``Stateful`` too; an EMA of FSDP2
parameters holds DTensors and is sharded like them.

An optimizer may have no state after steps were counted: fp16's gradient scaler skips the
steps whose gradients overflow, the first ones above all. ``get_state_dict`` would make such
a state up by stepping the optimizer with zero gradients (``_init_optim_state``), so it is
never asked: the checkpoint holds the model and the optimizer's hyperparameters only
(``HYPERPARAMETERS``, the key that says so), and its restore leaves the optimizer fresh.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

TRAINER = "trainer"
RNG = "rng"
COORDINATOR_ONLY = f"{TRAINER}.{RNG}."
"""Keys (DCP's flattened names) only the coordinator writes: per-rank values where one rank's
is restored everywhere."""
HYPERPARAMETERS = "optimizer_hyperparameters"
"""Under ``ModelState``'s key in place of ``optimizer``: the optimizer had no state (its groups'
hyperparameters only, e.g. the rate the scheduler set)."""


class ModelState(Stateful):
    """A model (plain, DDP or FSDP2) and its optimizer, as DCP saves and loads them."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.with_optimizer_state: bool | None = None
        """What a load expects of the checkpoint (``fit``); None: as the optimizer is."""

    def fit(self, names: frozenset[str] | None, key: str) -> None:
        """Before a load (``ShardedCheckpoints.load``): expect the optimizer's state only if
        the checkpoint (its DCP names, this object under ``key``) holds one. After it (None):
        as the optimizer is again."""
        if names is None:
            self.with_optimizer_state = None
            return
        self.with_optimizer_state = f"{key}.{HYPERPARAMETERS}" not in names

    def state_dict(self) -> dict[str, Any]:
        with_state = self.with_optimizer_state
        if with_state is None:
            with_state = bool(self.optimizer.state)
        if not with_state:  # never get_state_dict: it would make a step-1 state up
            groups = [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ]
            return {"model": get_model_state_dict(self.model), HYPERPARAMETERS: pack(groups)}
        init_optimizer_state(self.optimizer)  # a load into a fresh one: its peak, not torch's
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if HYPERPARAMETERS in state_dict:
            set_model_state_dict(self.model, state_dict["model"])
            self.optimizer.state.clear()  # fresh: its first step is the first it takes
            saved = unpack(state_dict[HYPERPARAMETERS])
            for group, values in zip(self.optimizer.param_groups, saved, strict=True):
                group.update(values)
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state as ``get_state_dict`` would (torch 2.13's
    ``_init_optim_state``: a step with a learning rate of 0 on gradients of zeros), but one
    parameter at a time. torch makes every gradient at once: as much memory again as the
    parameters, on top of the new state, at the peak of every restore. A load then overwrites
    the state; an optimizer that has a state, or gradients, is left as it is, as torch does."""
    groups = optimizer.param_groups
    if optimizer.state or any(p.grad is not None for g in groups for p in g["params"]):
        return
    rates = [group.get("lr") for group in groups]
    for group, lr in zip(groups, rates, strict=True):
        if lr is not None:
            group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
    try:
        for param in (p for g in groups for p in g["params"] if p.requires_grad):
            param.grad = torch.zeros_like(param)
            optimizer.step()  # steps only the parameters that have a gradient: this one
            param.grad = None
    finally:
        for group, lr in zip(groups, rates, strict=True):
            if lr is not None:
                group["lr"] = lr


class TrainerState(Stateful):
    """The loop's position and what it owns besides the model: the step, the samples consumed
    (the sampler's position), the LR scheduler, torch's RNG streams and the task's extras."""

    def __init__(
        self,
        step: int = 0,
        consumed_samples: int = 0,
        scheduler: Any | None = None,
        extras: Mapping[str, Stateful] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.step, self.consumed_samples = step, consumed_samples
        self.scheduler = scheduler
        self.extras = dict(extras or {})
        self.device = device or torch.device("cpu")

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            RNG: rng_state(self.device),
            "extras": {name: extra.state_dict() for name, extra in self.extras.items()},
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.consumed_samples = int(state_dict["consumed_samples"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        for name, extra in self.extras.items():
            extra.load_state_dict(state_dict["extras"][name])
        set_rng_state(state_dict[RNG], self.device)


def resolve(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as plain values, each ``Stateful`` part by its ``state_dict`` (its tensors the
    live ones): what DCP writes of it, and what a DDP restore sends."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def training_state(model_state: ModelState, trainer: TrainerState) -> dict[str, Stateful]:
    """The state dict a sharded checkpoint saves and loads: ``dcp.save``/``dcp.load`` call
    each part's ``state_dict`` (and ``load_state_dict`` after a load)."""
    return {"model": model_state, TRAINER: trainer}


def pack(value: Any) -> bytes:
    """A small tree (hyperparameters, the identity, the settings) as one value: DCP would
    otherwise flatten it into one item per leaf, and a checkpoint then only loads into the very
    same keys."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)  # data, never code


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's RNG streams this worker uses: the CPU generator's, and its GPU's."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class CoordinatorSavePlanner(DefaultSavePlanner):
    """DCP's default planner, but the items of ``COORDINATOR_ONLY`` come from the coordinator:
    which rank writes a replicated item is otherwise whichever had written least so far."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if self.is_coordinator:
            return plan
        items = [i for i in plan.items if not i.index.fqn.startswith(COORDINATOR_ONLY)]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan


def replicated_share(flat: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """The items of a replicated state (DDP: every rank holds all of them; ``flat`` is DCP's
    flattened form) that ``rank`` of ``world`` writes: each tensor to the rank that has the
    fewest bytes so far, largest first, so the ranks write about equal parts; every other
    value, and the coordinator's RNG streams, to rank 0. Every rank computes the same split
    with no message, and together the shares are the whole state: a collective DCP save of
    them holds each item once, and no rank copies more than its share to save it."""
    load = [0] * world
    owner: dict[str, int] = {}
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    for key in sorted(tensors, key=lambda k: (-tensors[k].nbytes, k)):
        if key.startswith(COORDINATOR_ONLY):
            owner[key] = 0
            continue
        owner[key] = min(range(world), key=lambda r: (load[r], r))
        load[owner[key]] += tensors[key].nbytes
    return {k: v for k, v in flat.items() if owner.get(k, 0) == rank}
