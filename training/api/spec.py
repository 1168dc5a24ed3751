"""The contract between a task (the user's model and data) and the elastic training loop.

A task is a ``TrainSpec``: what it builds and computes. The loop owns the rest: which samples
each rank takes at each step (by global sample index, training/data/sampler.py), gradient
accumulation that keeps the global batch fixed at every world size, the state (model,
optimizer, scheduler, RNG, step, epoch), its saves and restores, the step guard, faults,
endings, exit codes and the log lines. docs/your-own-model.md walks through a port.

Shaped after torchtitan's ``TrainSpec``: a frozen record of builders and functions, one per
task, found by name in one registry (``training/tasks/__init__.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from training.api.extras import Extra
from training.api.keyed_random import sample_seed_tensor


class TaskContractError(ValueError):
    """The task breaks the contract in a way that would break exact resume; the message says
    what was seen and the fix. Bad input: the same in every round, so no restart helps."""


def require_at_least(options: Any, least: float, *names: str) -> None:
    """ValueError naming the flag (``--n-layer``) of the first option below ``least``."""
    for name in names:
        if (value := getattr(options, name)) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")


class Samples(Protocol):
    """A training or validation split: indexable by sample, with a digest of its content."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...

    @property
    def digest(self) -> str:
        """SHA-256 of the content: a state is never resumed over other data of the same size."""
        ...


class Stream(Protocol):
    """A training split read in order (a corpus streamed from Blob, a log): no length, no
    random access. Global batch ``s`` is items ``s*G .. s*G+G-1`` of the stream, the item's
    position is its sample index, and the loop's step is the whole position, the same at any
    world size (training/data/loader.py)."""

    @property
    def identity(self) -> str:
        """What names the content, e.g. ``name@version`` or a manifest's digest: a state is
        never resumed over another stream."""
        ...

    def read(self, start: int) -> Iterator[Any]:
        """The items from position ``start`` (0-based) on, in the stream's order; the same
        items for the same positions in every process and every run."""
        ...


def is_stream(train: Samples | Stream) -> bool:
    """Whether a training split is a stream (read in order) rather than indexable samples."""
    return callable(getattr(train, "read", None)) and not hasattr(train, "__getitem__")


@dataclass(frozen=True)
class Data:
    """What ``TrainSpec.load_data`` returns."""

    train: Samples | Stream
    """The samples the loop draws global batches from: indexable, or a stream read in
    order."""
    validation: Samples | None = None
    """What ``TrainSpec.evaluate`` reads, if the task evaluates."""


@dataclass(frozen=True)
class BuildContext:
    """The loop's settings a task's parts depend on."""

    lr: float
    """The learning rate (``--lr``): the peak of a schedule. Nothing here depends on
    ``--max-steps``: a run may be extended, so a schedule's length is one of the task's
    options."""
    global_batch_size: int
    """Samples per optimiser step, whatever the world size."""


@dataclass
class TrainParts:
    """What ``TrainSpec.build`` returns: the objects whose state the loop keeps."""

    model: nn.Module
    """The network, on the CPU; the loop moves it to the device and dtype, wraps it in DDP.
    Under ``--parallelism fsdp2`` it is built on the meta device (no memory) and the loop
    shards and materializes it (``TrainSpec.parallelize``, ``TrainSpec.init_weights``)."""
    optimizer: torch.optim.Optimizer
    """Over ``model``'s parameters; stepped by the loop once per global batch."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    """Stepped by the loop after each optimizer step, saved and restored with it."""
    max_grad_norm: float | None = None
    """Clip the global gradient's norm to this before each optimizer step (None: no clip)."""
    extras: Mapping[str, Extra] = field(default_factory=dict)
    """State the loop keeps with the model: updated after each optimizer step, saved and
    restored with the checkpoint, by name (an EMA of the parameters: ``EMA(decay)``)."""


@dataclass(frozen=True)
class ParallelContext:
    """What ``TrainSpec.parallelize`` needs to shard a model (``--parallelism fsdp2``)."""

    mesh: DeviceMesh
    """The 1-D mesh over all ranks: pass it to ``fully_shard(module, mesh=ctx.mesh)``."""


@dataclass(frozen=True)
class MicroBatch:
    """Where a micro-batch sits: what ``collate`` and ``loss`` may read, and nothing else."""

    indices: torch.Tensor
    """Global sample indices (int64): the same sample has the same index at any world size."""
    step: int
    """The optimiser step (0-based) this micro-batch belongs to."""
    epoch: int
    """The epoch ``step`` draws from."""
    seed: int
    """The run's seed (``--seed``)."""
    device: torch.device
    """Where the model is."""

    def sample_seeds(self, stream: int) -> torch.Tensor:
        """One 63-bit seed per sample of this micro-batch (int64, on ``device``), keyed by
        (seed, stream, step, sample index): randomness drawn from it is the same at any world
        size and after any resume, and needs no state. Use a distinct ``stream`` per use
        (dropout, augmentation, ...); ``keyed_dropout`` and ``keyed_uniform`` take it."""
        keys = (self.seed, stream, self.step)
        return sample_seed_tensor(keys, self.indices.to(self.device))


@dataclass(frozen=True)
class EvalContext:
    """What ``evaluate`` may read: the step, the task's options, this rank's place."""

    step: int
    seed: int
    device: torch.device
    rank: int
    world_size: int
    options: Any
    """The task's options (its ``TrainSpec.options`` dataclass, as configured)."""

    def share(self, count: int) -> range:
        """This rank's contiguous share of ``count`` evaluation items (every item once)."""
        base, extra = divmod(count, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))


@dataclass(frozen=True)
class Evaluation:
    """One rank's part of an evaluation: the loop sums ``loss_sum`` and ``count`` over ranks."""

    loss_sum: float
    """Sum of the per-item losses of this rank's share."""
    count: int
    """Items in this rank's share."""
    text: str | None = None
    """A line for the log (rank 0's is logged), e.g. a sampled line of text."""


@dataclass(frozen=True)
class TrainSpec:
    """A task: its settings, data, parts, and how a loss is computed from a micro-batch."""

    name: str
    """What ``--task`` (``TRAIN_TASK``) and the stack's ``task`` call it."""
    options: type
    """A dataclass of the task's own settings: every field has a default and a docstring
    under it, and becomes a flag (``--field-name``, env ``TRAIN_FIELD_NAME``)."""
    load_data: Callable[[str, Any], Data]
    """``load_data(data_dir, options)``: the samples, read before any collective. Raise
    ``ValueError`` or ``OSError`` with a message naming the file and the fix."""
    build: Callable[[Any, Data, BuildContext], TrainParts]
    """``build(options, data, run)``: model, optimizer, scheduler. Called after the loop seeded
    torch with ``--seed``: every rank builds the same initial weights."""
    collate: Callable[[Sequence[Any], MicroBatch], Any]
    """``collate(items, where)``: ``items[i]`` is ``train[where.indices[i]]`` (a stream's
    item at that position); returns the batch
    (tensors, or tuples or dicts of them, on the CPU; the loop moves them)."""
    loss: Callable[[nn.Module, Any, MicroBatch], torch.Tensor | tuple[torch.Tensor, Any]]
    """``loss(model, batch, where)``: the SUM over the micro-batch's samples of each sample's
    loss (the loop scales it so the gradient is the global batch's mean at any world size);
    or a pair ``(sum, count)``: the sum of any per-item losses (tokens, not padding) and how
    many items it sums (a number or a scalar tensor), for a gradient of the mean over the
    count of the whole global batch, all ranks and micro-batches. Return the same kind every
    time. Randomness comes from ``where.sample_seeds``, never from torch's global RNG.
    ``model`` is the module as the loop wraps it (DDP, compiled): call it, do not reach into
    its attributes (``evaluate`` gets the module itself)."""
    evaluate: Callable[[nn.Module, Data, EvalContext], Evaluation] | None = None
    """Run every ``--eval-every`` steps on every rank, in ``eval()`` mode without gradients."""
    check: Callable[[Any], None] | None = None
    """``check(options)``: raise ``ValueError`` naming the flag when an option is out of range;
    run with the loop's own checks, before any collective."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """The task's own defaults for the loop's settings (``{"lr": 3e-4}``); flags and env win."""
    parallelize: Callable[[nn.Module, ParallelContext], None] | None = None
    """``parallelize(model, ctx)``: shard the model in place with ``fully_shard`` (from
    ``torch.distributed.fsdp``), its units first (each transformer block), then the root,
    as torchtitan's ``parallelize_fn``: one unit's parameters are gathered whole only while
    it runs. Called on the meta-device model of ``build``. None: the task runs under DDP
    only, and ``--parallelism fsdp2`` is refused."""
    init_weights: Callable[[nn.Module], None] | None = None
    """``init_weights(model)``: set every parameter and buffer (torchtitan's
    ``init_weights``). The sharded model is materialized uninitialized, so its values come
    from this alone; torch is seeded with ``--seed`` first, and random in-place inits
    (``nn.init.normal_``...) give every shard its part of the whole tensor's draw, so the
    initial model is the same at any world size (not the DDP run's: that one's draw follows
    the layers' own default inits). Call it from the model's constructor too, so that under
    DDP the model is initialized by it as well."""
    state_options: tuple[str, ...] | None = None
    """The options that change what the saved state means (the parameters' shapes, the
    samples): part of the run's identity, so a state is never resumed under other values. The
    others (a learning rate's schedule, dropout, weight decay) may change on a resume, and are
    used from the next step. None: every option, the safe default."""


def checked_extras(task: str, extras: Mapping[str, Extra]) -> dict[str, Extra]:
    """A task's extras, by names a checkpoint can hold beside the loop's own state."""
    for name in extras:
        if not name.isidentifier() or name == "scaler":
            raise TaskContractError(
                f"task {task!r}: an extra's name must be a Python identifier other than "
                f"'scaler' (the loop's), got {name!r}"
            )
    return dict(extras)
