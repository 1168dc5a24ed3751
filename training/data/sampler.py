"""Which samples each rank trains on at each step, whatever the world size.

Megatron's pattern: one global permutation per epoch, seeded by (seed, epoch); the global
batch is a fixed-size window into it, picked by the step alone; each rank takes a contiguous
share of that window. The concatenation of the shares over the ranks is the same global
batch at any world size, and resuming at step k needs nothing but k. torch's
``DistributedSampler`` cannot do this: it keeps no resume position, and it pads the sample
count to a multiple of the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from training.api.keyed_random import splitmix64

_MASK64 = (1 << 64) - 1


def _require_int(name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Optimiser steps in one epoch; the last partial global batch is dropped."""
    _require_int("global_batch", global_batch, 1)
    _require_int("num_samples", num_samples, 1)
    if num_samples < global_batch:
        raise ValueError(
            f"num_samples ({num_samples}) must be >= global_batch ({global_batch}): "
            "an epoch must hold at least one full global batch"
        )
    return num_samples // global_batch


@lru_cache(maxsize=4)
def _cached_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator()
    # Mixing, not seed + epoch: run (seed=1, epoch=0) must not replay (seed=0, epoch=1).
    generator.manual_seed(splitmix64(splitmix64(seed & _MASK64) ^ epoch))
    return torch.randperm(num_samples, generator=generator)


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order of sample indices: the same on every rank, in every run."""
    _require_int("num_samples", num_samples, 1)
    _require_int("epoch", epoch, 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    # A clone: callers may write into the result; the cached copy must stay intact.
    return _cached_permutation(num_samples, seed, epoch).clone()


def rank_share(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s contiguous slice of the global batch.

    Counts differ by at most one; the first ``global_batch % world_size`` ranks take one
    more. The slices cover the batch exactly once, in rank order.
    """
    _require_int("global_batch", global_batch, 1)
    _require_int("world_size", world_size, 1)
    if world_size > global_batch:
        raise ValueError(
            f"world_size ({world_size}) must be <= global_batch ({global_batch}): "
            "every rank needs at least one sample"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
    base, extra = divmod(global_batch, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def micro_batches(count: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """(offset, size) chunks of a share, for gradient accumulation; only the last is short."""
    _require_int("count", count, 0)
    _require_int("micro_batch_size", micro_batch_size, 1)
    return [
        (offset, min(micro_batch_size, count - offset))
        for offset in range(0, count, micro_batch_size)
    ]


def loss_scale(count: int, world_size: int, global_batch: int) -> float:
    """Factor for a rank's *summed* per-sample loss so DDP yields the global-batch mean's gradient.

    DDP averages gradients over ranks: g = (1/W) * sum_r g_r. With g_r the gradient of
    ``s * (sum of the rank's per-sample losses)``, g equals the gradient of the mean over the
    global batch G exactly when s / W = 1 / G, i.e. s = W / G, the same on every rank.
    Taking each rank's *mean* instead gives g = (1/W) * sum_r (1/c_r) * sum_{i in r} grad_i,
    which over-weights the samples of ranks with the smaller share whenever G % W != 0, so
    the trajectory would change with the world size. ``count`` (this rank's share) is only
    checked: the factor does not depend on it, and micro-batches of a share use it as well.
    """
    _require_int("global_batch", global_batch, 1)
    _require_int("world_size", world_size, 1)
    if world_size > global_batch:
        raise ValueError(f"world_size ({world_size}) must be <= global_batch ({global_batch})")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= global_batch:
        raise ValueError(f"count must be in 1..{global_batch}, got {count!r}")
    return world_size / global_batch


@dataclass(frozen=True)
class ElasticSampler:
    """Sample indices for optimiser step ``step`` (0-based); the step is the whole position."""

    num_samples: int
    """Samples in the training split."""
    global_batch: int
    """Samples per optimiser step, summed over all ranks; fixed whatever the world size."""
    seed: int
    """Seeds every epoch's permutation."""

    def __post_init__(self) -> None:
        steps_per_epoch(self.num_samples, self.global_batch)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch."""
        return self.num_samples // self.global_batch

    def epoch_of(self, step: int) -> int:
        """The epoch that step ``step`` draws from."""
        _require_int("step", step, 0)
        return step // self.steps_per_epoch

    def global_indices(self, step: int) -> torch.Tensor:
        """The global batch of sample indices for ``step``: a window into its epoch's order."""
        epoch = self.epoch_of(step)
        start = (step % self.steps_per_epoch) * self.global_batch
        return epoch_permutation(self.num_samples, self.seed, epoch)[
            start : start + self.global_batch
        ]

    def rank_indices(self, step: int, world_size: int, rank: int) -> torch.Tensor:
        """This rank's contiguous share of ``global_indices(step)``."""
        start, count = rank_share(self.global_batch, world_size, rank)
        return self.global_indices(step)[start : start + count]

    def consumed_samples(self, step: int) -> int:
        """Samples taken by steps 0..step-1, i.e. once ``step`` steps have completed."""
        _require_int("step", step, 0)
        return step * self.global_batch

    def state_dict(self) -> dict[str, int]:
        """What fixes the sample order; a checkpoint keeps it to refuse a mismatched resume."""
        return {
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class StreamSampler:
    """A stream's positions for optimiser step ``step``: global batch ``s`` is positions
    ``s*G .. s*G+G-1``, one pass in the stream's own order (epoch 0 throughout). As with
    ``ElasticSampler`` the step is the whole position, so a resume at another world size
    continues where the global stream stopped."""

    global_batch: int
    """Items per optimiser step, summed over all ranks."""

    def __post_init__(self) -> None:
        _require_int("global_batch", self.global_batch, 1)

    def epoch_of(self, step: int) -> int:
        _require_int("step", step, 0)
        return 0

    def global_indices(self, step: int) -> torch.Tensor:
        start = self.consumed_samples(step)
        return torch.arange(start, start + self.global_batch, dtype=torch.int64)

    def rank_indices(self, step: int, world_size: int, rank: int) -> torch.Tensor:
        start, count = rank_share(self.global_batch, world_size, rank)
        return self.global_indices(step)[start : start + count]

    def consumed_samples(self, step: int) -> int:
        _require_int("step", step, 0)
        return step * self.global_batch

    def state_dict(self) -> dict[str, int]:
        return {"global_batch": self.global_batch}
