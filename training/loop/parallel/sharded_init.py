"""Random init of sharded parameters that is the same at any world size.

DTensor's own random ops are world-size independent only where its offset-based RNG tracker
runs: torch 2.13's ``torch/distributed/tensor/_random.py`` (``is_rng_supported_mesh``) needs a
device module with ``set_rng_state``, which ``torch.cpu`` lacks. On a CPU mesh (gloo) each rank
then draws its local shard from its own generator: with the same seed on every rank, every
shard of a parameter gets the same values (repeated rows, a symmetry training never breaks),
and the model changes with the world size. So, while a task's ``init_weights`` runs, each
in-place random op on a DTensor draws the whole tensor, as an unsharded model would, and
keeps this rank's shard: one parameter whole at a time, never the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
RANDOM_IN_PLACE = {
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.geometric_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),  # a keyword in Python
    aten.random_.to,
}
"""What ``nn.init``'s random functions come down to (``trunc_normal_`` is ``uniform_`` and
elementwise math, ``kaiming_*`` and ``xavier_*`` are ``uniform_`` or ``normal_``)."""


class _WholeTensorDraws(TorchDispatchMode):
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func not in RANDOM_IN_PLACE or not isinstance(target, DTensor):
            return func(*args, **kwargs)
        local = target._local_tensor
        whole = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(whole, *args[1:], **kwargs)  # the same draw on every rank: the same seed
        # src_data_rank=None: each rank cuts its own shard from its own copy, no collective.
        shard = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
        local.copy_(shard.to_local())
        return target


@contextmanager
def whole_tensor_init() -> Iterator[None]:
    """In-place random ops on DTensors draw the whole tensor and keep this rank's shard."""
    with _WholeTensorDraws():
        yield
