"""The step guard, the NCCL settings, and a fork server that never touches CUDA.

The end-to-end proof on CPU (NCCL's stream-ordered completion emulated on gloo, a peer killed, 0
steps lost and the trajectory kept) is in ``tests/training/test_elastic_training.py``. The NCCL test
below runs only where two GPUs are at hand.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.waiting import holds_within
from training.loop.step_guard import (
    EMULATE_ENV,
    StepGuard,
    _to_cpu,
    cpu_state,
    needs_guard,
    stream_ordered_allreduce_hook,
)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gloo_needs_no_guard_nccl_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    assert not needs_guard("gloo") and needs_guard("nccl")
    monkeypatch.setenv(EMULATE_ENV, "1")
    assert needs_guard("gloo")


def test_the_guard_passes_when_every_rank_finished(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")
    guard = StepGuard.create("gloo", timeout_s=10)
    assert guard.active
    guard.check()
    monkeypatch.delenv(EMULATE_ENV)
    assert not StepGuard.create("gloo", timeout_s=10).active


def test_the_cpu_copy_keeps_the_state_tree() -> None:
    state = {"w": torch.ones(2), "nested": [torch.zeros(1), (torch.full((1,), 2.0),)], "step": 3}
    copied = _to_cpu(state)
    assert copied["step"] == 3 and isinstance(copied["nested"][1], tuple)
    assert torch.equal(copied["w"], state["w"]) and torch.equal(
        copied["nested"][1][0], state["nested"][1][0]
    )


def _window_rank(rank: int, root: str, results: dict) -> None:
    os.environ[EMULATE_ENV] = "1"
    store = dist.FileStore(f"{root}/init", 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        guard = StepGuard.create("gloo", timeout_s=30)
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        ddp.register_comm_hook(guard.stream, stream_ordered_allreduce_hook)
        passed = Path(root) / "rank-1-passed-the-guard"
        if rank == 0:
            # Rank 0's stream is busy with earlier work until rank 1 passed its guard (or a
            # while: the guard must not let rank 1 pass before this rank's all-reduce ran).
            guard.stream.enqueue(lambda: holds_within(passed.exists, 3.0))
        ddp(torch.full((1, 64), float(rank + 1))).sum().backward()
        results[f"backward-{rank}"] = float(model.weight.grad[0, 0])
        guard.check()
        results[f"guard-{rank}"] = float(model.weight.grad[0, 0])
        if rank == 1:
            passed.touch()
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_no_rank_passes_the_guard_before_every_all_reduce_finished(tmp_path: Path) -> None:
    # d(sum(Wx + b))/dW is x: 1 on rank 0, 2 on rank 1; the reduced gradient is their mean.
    results = mp.Manager().dict()
    mp.spawn(_window_rank, args=(str(tmp_path), results), nprocs=2, join=True)
    # The emulation has NCCL's ordering: backward() returned with the all-reduce only queued.
    assert results["backward-1"] == 1.0
    # The guard proved it finished everywhere: both apply the fully reduced gradient.
    assert (results["guard-0"], results["guard-1"]) == (1.5, 1.5)


def test_the_window_loss_goes_over_the_guards_gloo_group(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")
    guard = StepGuard.create("gloo", timeout_s=10)
    groups: list[object] = []
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        groups.append(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert guard.all_reduce(torch.tensor([2.0, 4.0])).tolist() == [2.0, 4.0]
    assert groups == [guard.group] and guard.group is not None


# ---- NCCL, for the day two GPUs are at hand -----------------------------------------------------


def _nccl_rank(rank: int, port: int, results: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCH_NCCL_ASYNC_ERROR_HANDLING="2",
        TORCH_NCCL_BLOCKING_WAIT="0",
    )
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    guard = StepGuard.create("nccl", timeout_s=5)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(256, 256).cuda(), device_ids=[rank]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 6):
        if rank == 1 and step == 4:
            os._exit(0)  # the peer vanishes mid-run
        optimizer.zero_grad()
        model(torch.randn(32, 256, device="cuda")).sum().backward()
        started = time.monotonic()
        try:
            guard.check()
        except Exception:
            results["caught_after_s"] = time.monotonic() - started
            results["step"] = step - 1
            break
        optimizer.step()
    from training.loop.step_guard import abort_collectives

    abort_collectives()
    started = time.monotonic()
    state = cpu_state(model.module.state_dict())
    results["saved_after_s"] = time.monotonic() - started
    results["on_cpu"] = all(not t.is_cuda for t in state.values())
    os._exit(0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_on_nccl_a_vanished_peer_raises_before_the_step_and_the_save_does_not_hang() -> None:
    from tests.support.loopback import free_port

    results = mp.Manager().dict()
    mp.spawn(_nccl_rank, args=(free_port(), results), nprocs=2, join=True)
    assert results["step"] == 3
    assert results["caught_after_s"] < 5 + 2
    assert results["saved_after_s"] < 10 and results["on_cpu"]
