"""``--parallelism fsdp2`` against ddp: charlm trained by the loop's own step on 2 and 3 gloo
processes in float64 (micro-batches, dropout, a (sum, count) loss, clipping), its parameters
and its evaluation within 1e-9 of ddp's; built on meta, no rank holding more than its shards."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.support.exactness import CORPUS_SAMPLE
from tests.support.trainer_harness import harness
from training.api import TrainParts
from training.loop.dist import DistEnv
from training.loop.metrics import Phases
from training.loop.parallel import clip_grad_norm
from training.tasks.charlm import SPEC, init_weights

STEPS = 4
TINY = [
    "--task=charlm",
    "--dtype=float64",
    "--n-layer=2",
    "--n-embd=16",
    "--n-head=2",
    "--block-size=16",
    "--global-batch-size=12",
    "--micro-batch-size=2",  # 2-3 micro-batches per rank: the gradients accumulate
    "--grad-clip=0.05",  # below the gradient's norm: every step clips
    "--eval-chunks=6",
    "--sample-chars=8",
    "--max-steps=100",
]


def _built_on(devices: list[str]) -> Any:
    """charlm's build, noting the device its parameters were made on."""

    def build(options: Any, data: Any, run: Any) -> TrainParts:
        parts = SPEC.build(options, data, run)
        devices.extend(p.device.type for p in parts.model.parameters())
        return parts

    return dataclasses.replace(SPEC, build=build)


def _train(root: Path, data_dir: Path, parallelism: str, rank: int, world: int) -> Any:
    devices: list[str] = []
    env = DistEnv(rank=rank, world_size=world, local_world_size=world, local_rank=rank)
    h = harness(
        root / f"{parallelism}-{rank}",
        data_dir,
        f"--parallelism={parallelism}",
        env=env,
        tiny=TINY,
        spec=_built_on(devices),
    )
    trainer = h.trainer
    if parallelism == "ddp":  # fsdp2's init: torch seeded, init_weights on the whole model
        torch.manual_seed(trainer.cfg.run.seed)
        init_weights(trainer.model)
    trainer._wrap(Phases())
    for _ in range(STEPS):
        trainer.train_step()
    trainer.evaluate()
    return trainer, set(devices)


def _check_clip_on_shards(model: torch.nn.Module, rank: int) -> None:
    """Sharded gradients clipped as the whole gradient would be."""
    whole = {}
    for name, param in model.named_parameters():
        generator = torch.Generator().manual_seed(len(whole))
        full = torch.randn(param.shape, generator=generator, dtype=param.dtype)
        whole[name] = full
        param.grad = distribute_tensor(full, param.device_mesh, param.placements)
    clip_grad_norm(model.parameters(), 0.5)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in whole.values()]))
    assert total > 1.0
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad.full_tensor(), whole[name] * 0.5 / (total + 1e-6)), name


def _worker(rank: int, world: int, root: str, data_dir: str) -> None:
    base = Path(root)
    store = dist.FileStore(str(base / "init"), world)
    store.set_timeout(timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        ddp, ddp_devices = _train(base, Path(data_dir), "ddp", rank, world)
        sharded, fsdp_devices = _train(base, Path(data_dir), "fsdp2", rank, world)
        assert ddp_devices == {"cpu"} and fsdp_devices == {"meta"}, (ddp_devices, fsdp_devices)
        model = sharded.model
        # No rank holds the whole model: every parameter a DTensor, this rank's rows only.
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            rows = torch.arange(param.shape[0]).chunk(world)
            expected = len(rows[rank]) if rank < len(rows) else 0
            assert param.to_local().shape[0] == expected, (name, param.to_local().shape)
        assert model.head.weight is model.tokens.weight  # still tied: one parameter
        found = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        expected = {n: p.detach() for n, p in ddp.model.named_parameters()}
        evals = (sharded.last_eval_loss, ddp.last_eval_loss)
        _check_clip_on_shards(model, rank)
        if rank == 0:
            torch.save({"found": found, "expected": expected, "evals": evals}, base / "out.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_trains_charlm_as_ddp_does(tmp_path: Path, world: int) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "input.txt").write_text(CORPUS_SAMPLE.read_text()[:4000])
    mp.spawn(_worker, args=(world, str(tmp_path), str(data_dir)), nprocs=world)
    out = torch.load(tmp_path / "out.pt")
    found, expected = out["found"], out["expected"]
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        error = float((found[name] - tensor).norm() / tensor.norm())
        assert error <= 1e-9, (name, error)
    initial = torch.nn.Embedding(*expected["tokens.weight"].shape, dtype=torch.float64)
    assert not torch.allclose(initial.weight, expected["tokens.weight"])
    sharded_eval, ddp_eval = out["evals"]
    assert sharded_eval is not None and sharded_eval == pytest.approx(ddp_eval, rel=1e-9)
