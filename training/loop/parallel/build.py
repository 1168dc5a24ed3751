"""A task's parts on the ranks: built whole (DDP), or sharded (FSDP2).

FSDP2 follows torchtitan: ``build`` under ``torch.device("meta")`` (shapes, no memory),
``parallelize`` (``fully_shard`` each unit, then the root), ``to_empty`` (each rank allocates
its shards only), then ``init_weights``. ``fully_shard`` replaces the model's Parameter
objects with sharded DTensor ones, so the optimizer the task built over the meta parameters
is pointed at them by parameter name, its groups and hyperparameters kept (the scheduler
keeps its optimizer object).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from training.api import BuildContext, Data, ParallelContext, TrainParts, TrainSpec
from training.loop.config import TrainConfig
from training.loop.parallel.sharded_init import whole_tensor_init


def build_parts(
    spec: TrainSpec, cfg: TrainConfig, data: Data, device: torch.device, dtype: torch.dtype
) -> TrainParts:
    """The task's parts on ``device`` in ``dtype``, spread as ``--parallelism`` says. Called
    with torch seeded by ``--seed`` and, for fsdp2, the default process group up."""
    run = BuildContext(cfg.optim.lr, cfg.optim.global_batch_size)
    if cfg.run.parallelism == "ddp":
        parts = spec.build(cfg.options, data, run)
        # In place: the optimizer's references to the parameters stay valid.
        parts.model.to(device=device, dtype=dtype)
        return parts
    return _sharded_parts(spec, cfg, data, run, device, dtype)


def _sharded_parts(
    spec: TrainSpec,
    cfg: TrainConfig,
    data: Data,
    run: BuildContext,
    device: torch.device,
    dtype: torch.dtype,
) -> TrainParts:
    # config.validate refused fsdp2 for a task without these, before the node joined.
    assert spec.parallelize is not None and spec.init_weights is not None
    with torch.device("meta"):
        parts = spec.build(cfg.options, data, run)
    model = parts.model.to(dtype=dtype)  # on meta: the dtype of the shards to come
    names = parameter_names(model)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    spec.parallelize(model, ParallelContext(mesh))
    repoint_optimizer(parts.optimizer, names, model)
    model.to_empty(device=device)
    torch.manual_seed(cfg.run.seed)
    with torch.no_grad(), whole_tensor_init():
        spec.init_weights(model)
    return parts


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Each parameter object's name (a tied parameter: its first name, as
    ``named_parameters`` gives it)."""
    return {id(p): name for name, p in model.named_parameters()}


def repoint_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module
) -> None:
    """Point ``optimizer``'s groups at ``model``'s parameters of the same names, in place: the
    groups' order, membership and hyperparameters stay as the task built them."""
    if optimizer.state:
        raise RuntimeError("the optimizer was stepped before the model was sharded")
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [current[names[id(p)]] for p in group["params"]]
        except KeyError as exc:
            raise RuntimeError(
                f"the optimizer holds a parameter the model does not ({exc}): build it over "
                "model.parameters()"
            ) from None
