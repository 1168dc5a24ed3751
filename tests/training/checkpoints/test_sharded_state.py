"""Sharded checkpoints across processes: saved at one world size, loaded and trained on at
another, for DDP and FSDP2 (``fully_shard`` on the CPU with gloo), in float64.

Each rank trains on its share of one global batch, so the trajectory is the same at any world
size: after a save at world N and a load at world M, the final parameters, the optimizer's
effect, the scheduler and a task's extra (an EMA, sharded like the parameters under FSDP2)
must match an uninterrupted run in this process within 1e-9 (relative)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint.stateful import Stateful

from tests.support.waiting import gloo_group
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import (
    ModelState,
    TrainerState,
    init_optimizer_state,
    training_state,
)
from training.checkpoints.storage import FileStore

GLOBAL_BATCH = 12
SAVE_AT, STEPS = 3, 6
SAVED_SEED, OTHER_SEED = 0, 99


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=torch.float64)
    return x, torch.randn(GLOBAL_BATCH, 3, generator=generator, dtype=torch.float64)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]
    return torch.nn.Sequential(*layers).double()


class EMA(Stateful):
    """A task's extra: an average of the parameters (DTensors, sharded, under FSDP2)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            self.shadow[name].mul_(0.9).add_(param.detach(), alpha=0.1)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": dict(self.shadow)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, tensor in self.shadow.items():
            tensor.copy_(state_dict["shadow"][name])  # DCP loaded in place: a no-op here


class Run:
    """One rank's training: the model (wrapped), its optimizer, scheduler, EMA, trainer state."""

    def __init__(self, mode: str, seed: int, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.model = _model(seed)
        self.wrapped = _parallelize(self.model, mode, world)
        self.optimizer = torch.optim.AdamW(self.wrapped.parameters(), lr=0.05, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.ema = EMA(self.model)
        self.trainer = TrainerState(scheduler=self.scheduler, extras={"ema": self.ema})
        self.state = training_state(ModelState(self.wrapped, self.optimizer), self.trainer)

    def train_to(self, steps: int) -> None:
        while self.trainer.step < steps:
            x, y = _batch(self.trainer.step)
            share = list(range(self.rank, GLOBAL_BATCH, self.world))
            # The optimizer sees the global batch's mean gradient at any world size (DDP and
            # FSDP2 average the ranks' gradients).
            out = self.wrapped(x[share])
            loss = ((out - y[share]) ** 2).sum() / GLOBAL_BATCH * self.world
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.ema.update(self.model)
            self.trainer.step += 1
            self.trainer.consumed_samples += GLOBAL_BATCH

    def full(self) -> dict[str, torch.Tensor]:
        """The parameters and the EMA whole (a collective under FSDP2)."""
        found = {}
        parts = (("", self.model.named_parameters()), ("ema.", self.ema.shadow.items()))
        for prefix, named in parts:
            for name, tensor in named:
                whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                found[prefix + name] = whole.detach().clone()
        return found


def _parallelize(model: torch.nn.Module, mode: str, world: int) -> torch.nn.Module:
    if mode == "reference":
        return model
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _worker(rank: int, world: int, mode: str, phase: str, root: str) -> None:
    base = Path(root)
    with gloo_group(base / f"init-{phase}", rank, world):
        checkpoints = ShardedCheckpoints(FileStore(base / "store"), base / f"scratch-{rank}")
        if phase == "save":
            run = Run(mode, SAVED_SEED, rank, world)
            run.train_to(SAVE_AT)
            torch.manual_seed(1234 + rank)  # each rank's RNG its own: rank 0's is saved
            if rank == 0:
                torch.save(torch.get_rng_state(), base / "rng.pt")
            checkpoints.save(run.state, run.trainer.step)
            return
        run = Run(mode, OTHER_SEED, rank, world)  # everything must come from the checkpoint
        entry = checkpoints.load(run.state)
        assert entry is not None and entry.step == SAVE_AT, entry
        assert (run.trainer.step, run.trainer.consumed_samples) == (SAVE_AT, SAVE_AT * GLOBAL_BATCH)
        assert torch.equal(torch.get_rng_state(), torch.load(base / "rng.pt")), rank
        run.train_to(STEPS)
        full = run.full()
        if rank == 0:
            torch.save({**full, "lr": torch.tensor(run.scheduler.get_last_lr())}, base / "out.pt")


def _reference() -> dict[str, torch.Tensor]:
    run = Run("reference", SAVED_SEED, 0, 1)
    run.train_to(STEPS)
    return {**run.full(), "lr": torch.tensor(run.scheduler.get_last_lr())}


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("mode", "saved_at", "loaded_at"),
    [("ddp", 2, 3), ("ddp", 3, 2), ("fsdp2", 2, 3), ("fsdp2", 3, 2)],
)
def test_a_checkpoint_saved_at_one_world_size_resumes_exactly_at_another(
    tmp_path: Path, mode: str, saved_at: int, loaded_at: int
) -> None:
    mp.spawn(_worker, args=(saved_at, mode, "save", str(tmp_path)), nprocs=saved_at)
    files = [n for n in FileStore(tmp_path / "store").list("dcp-") if n.endswith(".distcp")]
    assert len(files) == saved_at  # every rank wrote a part, replicated (DDP) or sharded
    mp.spawn(_worker, args=(loaded_at, mode, "load", str(tmp_path)), nprocs=loaded_at)
    resumed, expected = torch.load(tmp_path / "out.pt"), _reference()
    assert resumed.keys() == expected.keys()
    for name, tensor in expected.items():
        error = float((resumed[name] - tensor).norm() / tensor.norm())
        assert error <= 1e-9, (name, error)
    assert not torch.equal(expected["0.weight"], _model(SAVED_SEED)[0].weight)  # it trained


@pytest.mark.parametrize("lr", [0.1, torch.tensor(0.1)], ids=["float", "tensor"])
def test_a_fresh_optimizer_gets_torchs_state_one_gradient_at_a_time(lr: Any) -> None:
    # What get_state_dict would make (torch's _init_optim_state, private: the reference
    # only), with never more than one gradient held; the parameters and the rate unchanged.
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    theirs_model, ours_model = _model(SAVED_SEED), _model(SAVED_SEED)
    theirs = torch.optim.AdamW(theirs_model.parameters(), lr=lr, weight_decay=0.1)
    ours = torch.optim.AdamW(ours_model.parameters(), lr=lr, weight_decay=0.1)
    _init_optim_state(theirs)
    held: list[int] = []
    step = ours.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        held.append(sum(p.grad is not None for p in ours_model.parameters()))
        return step(*args, **kwargs)

    ours.step = counted  # type: ignore[method-assign]
    init_optimizer_state(ours)
    assert held == [1] * len(list(ours_model.parameters()))
    torch.testing.assert_close(ours.state_dict(), theirs.state_dict(), rtol=0, atol=0)
    for mine, reference in zip(ours_model.parameters(), theirs_model.parameters(), strict=True):
        assert torch.equal(mine, reference) and mine.grad is None
    assert ours.param_groups[0]["lr"] is lr
    before = ours.state_dict()
    init_optimizer_state(ours)  # it has a state: left as it is
    torch.testing.assert_close(ours.state_dict(), before, rtol=0, atol=0)
