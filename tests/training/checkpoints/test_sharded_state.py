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

from tests.support.sharded_runs import (
    GLOBAL_BATCH,
    OTHER_SEED,
    SAVE_AT,
    SAVED_SEED,
    STEPS,
    Run,
    _model,
)
from tests.support.waiting import gloo_group
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import (
    init_optimizer_state,
)
from training.checkpoints.storage import FileStore


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
