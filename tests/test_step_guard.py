"""The step guard, the NCCL settings, and a fork server that never touches CUDA.

The end-to-end proof on CPU (NCCL's stream-ordered completion emulated on gloo, a peer killed,
0 steps lost and the trajectory kept) is in ``tests/test_elastic_training.py``. The NCCL test
below runs only where two GPUs are at hand.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.step_guard import EMULATE_ENV, StepGuard, _to_cpu, cpu_state, needs_guard


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
    from training.step_guard import abort_collectives

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
    from tests.conftest import free_loopback_port

    results = mp.Manager().dict()
    mp.spawn(_nccl_rank, args=(free_loopback_port(), results), nprocs=2, join=True)
    assert results["step"] == 3
    assert results["caught_after_s"] < 5 + 2
    assert results["saved_after_s"] < 10 and results["on_cpu"]
