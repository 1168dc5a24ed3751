"""The loop's side of the parallelism: what the step runs the model through, when the
micro-batches' gradients are synchronized, and the global gradient's norm.

DDP wraps the model and all-reduces the gradients once per step, on the last micro-batch
(``no_sync`` before). FSDP2 needs no wrapper (``fully_shard`` made the model its own) and
reduce-scatters every micro-batch's gradients: ``set_requires_gradient_sync(False)`` would
keep each unit's gradients unsharded until the last micro-batch, the whole model's gradient
on every rank, which is what FSDP2 is chosen to avoid (torchtitan accumulates the same way).
The mean over the ranks of the micro-batches' sums is the same gradient, within rounding.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel


def wrap_model(model: nn.Module, parallelism: str, device: torch.device, stream: Any) -> nn.Module:
    """The module the step runs: ``model`` in DDP, or, sharded, ``model`` itself. ``stream``
    is the step guard's: one a test supplies gives NCCL's ordering on gloo through its
    ``comm_hook`` (training/loop/step_guard.py, ``STREAM_ENV``)."""
    if parallelism == "fsdp2":
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    if (hook := getattr(stream, "comm_hook", None)) is not None:
        # Gradients are views of the buckets, which the queued all-reduce fills later.
        ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        ddp.register_comm_hook(stream, hook)
        return ddp
    return DistributedDataParallel(model, device_ids=device_ids)


def gradient_sync(wrapped: nn.Module, sync: bool) -> AbstractContextManager[Any]:
    """Around one micro-batch's backward: DDP all-reduces only when ``sync`` (the step's last
    micro-batch); FSDP2 reduce-scatters each one (see above)."""
    if not sync and isinstance(wrapped, DistributedDataParallel):
        return wrapped.no_sync()
    return nullcontext()


def compile_model(model: nn.Module, parallelism: str) -> None:
    """``--compile``, in place (``module.compile()``: the state_dict keeps its keys, where
    ``torch.compile(module)`` would add ``_orig_mod.``), so checkpoints are the same either way.

    DDP: the whole module DDP then wraps. PyTorch's "Where to apply torch.compile?"
    (docs.pytorch.org/docs/stable/compile/programming_model.where_to_apply_compile.html):
    torch.compile does not handle wrappers such as DDP well, so compile the inner module.

    FSDP2: each unit the task's ``parallelize`` sharded (its outermost ones below the root),
    as torchtitan compiles each transformer block (``apply_compile`` in
    torchtitan/models/llama3/infra/parallelize.py, before ``apply_fsdp``): a repeated
    structure, compiled once per distinct block, and the root's embedding and head stay
    eager. torchtitan compiles before ``fully_shard`` because it wraps the block; in place,
    the order makes no difference: FSDP2's hooks are ``torch._dynamo.disable``d (torch 2.13
    ``distributed/fsdp/_fully_shard/_fsdp_common.py`` ``_dynamo_disable``, on
    ``_fsdp_state.py``'s ``_pre_forward``/``_post_forward``), so they run eagerly around the
    compiled forward either way, and the loop needs nothing from the task. A task that
    sharded only the root gets the root compiled."""
    if parallelism != "fsdp2":
        model.compile()
        return
    units: list[str] = []
    for name, module in model.named_modules():
        below = any(name.startswith(f"{unit}.") for unit in units)
        if name and isinstance(module, FSDPModule) and not below:
            units.append(name)
            module.compile()
    if not units:
        model.compile()


def reshard(model: nn.Module) -> None:
    """Free a sharded model's gathered parameters: FSDP2's root unit keeps them after a
    forward that no backward follows (an evaluation), whole on every rank until the next
    step's backward, and a state read then would not be the shards."""
    if isinstance(model, FSDPModule):
        model.reshard()


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> None:
    """Clip the global gradient's norm to ``max_norm``: on sharded (DTensor) gradients the
    norm is reduced over the ranks' shards, so every rank scales by the same factor."""
    parameters = list(parameters)
    norm = gradient_norm(parameters)
    if norm is not None:
        clip_to_norm(parameters, max_norm, norm)


def gradient_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor | None:
    """The global gradient's norm, its reduction over the ranks' shards done here (a
    collective on sharded gradients, so it runs before the step guard's vote); None without
    gradients."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    norm = nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if isinstance(norm, AsyncCollectiveTensor):  # functional collectives wait on first use
        norm = norm.wait()
    return norm


def clip_to_norm(parameters: Iterable[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients so their global ``norm`` (``gradient_norm``'s) is at most
    ``max_norm``: no collective, the norm is the same on every rank."""
    with implicit_replication():  # the norm, a plain tensor, times each rank's shards
        nn.utils.clip_grads_with_norm_(list(parameters), max_norm, norm)
