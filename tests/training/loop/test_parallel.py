"""``--parallelism fsdp2`` against ddp: charlm trained by the loop's own step on 2 and 3 gloo
processes in float64 (micro-batches, dropout, a (sum, count) loss, clipping), its parameters
and its evaluation within 1e-9 of ddp's, and under bf16-mixed and fp16-mixed (the scaler
skipping the same steps); built on meta, no rank holding more than its shards. The flags
fsdp2 refuses, with one line each."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.support.exactness import CORPUS_SAMPLE
from tests.support.trainer_harness import harness, one_process_world
from tests.support.waiting import gloo_group
from training.api import TrainParts
from training.elastic.exit_codes import BAD_INPUT
from training.loop.config import ConfigError, parse_config
from training.loop.dist import DistEnv
from training.loop.metrics import Phases
from training.loop.parallel import clip_grad_norm
from training.tasks.charlm import SPEC, init_weights

REPO_ROOT = Path(__file__).resolve().parents[3]
REQUIRED = ["--data-dir", "/d", "--checkpoint-uri", "/c"]
STEPS = 4
FLOAT64 = ["--dtype=float64"]
BF16_MIXED = ["--dtype=float32", "--precision=bf16-mixed"]
FP16_MIXED = ["--dtype=float32", "--precision=fp16-mixed"]
FP16_STEPS = 10
"""fp16's scaler skips the first steps (their gradients overflow at its start): some train."""
TINY = [
    "--task=charlm",
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


def _train(
    root: Path,
    data_dir: Path,
    parallelism: str,
    rank: int,
    world: int,
    flags: list[str],
    steps: int,
) -> Any:
    devices: list[str] = []
    env = DistEnv(rank=rank, world_size=world, local_world_size=world, local_rank=rank)
    h = harness(
        root / f"{parallelism}-{rank}",
        data_dir,
        f"--parallelism={parallelism}",
        env=env,
        tiny=[*TINY, *flags],
        spec=_built_on(devices),
    )
    trainer = h.trainer
    if parallelism == "ddp":  # fsdp2's init: torch seeded, init_weights on the whole model
        torch.manual_seed(trainer.cfg.run.seed)
        init_weights(trainer.model)
    initial = trainer.model.tokens.weight.detach().clone()
    trainer._wrap(Phases())
    for _ in range(steps):
        trainer.train_step()
    # Between steps, where saves run, no gradient is held: the state alone.
    assert [n for n, p in trainer.model.named_parameters() if p.grad is not None] == []
    assert not torch.equal(trainer.model.tokens.weight.detach(), initial)  # it trained
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


def _worker(rank: int, world: int, root: str, data_dir: str, flags: list[str], steps: int) -> None:
    base = Path(root)
    with gloo_group(base / "init", rank, world):
        ddp, ddp_devices = _train(base, Path(data_dir), "ddp", rank, world, flags, steps)
        sharded, fsdp_devices = _train(base, Path(data_dir), "fsdp2", rank, world, flags, steps)
        scalers = (ddp.precision.state_dict(), sharded.precision.state_dict())
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
            out = {"found": found, "expected": expected, "evals": evals, "scalers": scalers}
            torch.save(out, base / "out.pt")


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "flags", "tolerance", "steps"),
    [
        # At 3 ranks: tests/training/test_elastic_training_fsdp2.py ends runs at world 3
        # within 1e-9 of a world-2 run.
        (2, FLOAT64, 1e-9, STEPS),
        # Autocast in bf16 from float32 parameters: the same computation, float32's rounding
        # (measured: at most 1.2e-8).
        (2, BF16_MIXED, 1e-6, STEPS),
        # Autocast in fp16, the scaler skipping the same steps on both (DTensor max-reduces
        # found_inf over the shards: torch 2.13 distributed/tensor/_dispatch.py,
        # found_inf_reduce_handler), as bf16's: float32's rounding (measured: 8.1e-8).
        (2, FP16_MIXED, 1e-6, FP16_STEPS),
    ],
    ids=["float64-2", "bf16-mixed-2", "fp16-mixed-2"],
)
def test_fsdp2_trains_charlm_as_ddp_does(
    tmp_path: Path, world: int, flags: list[str], tolerance: float, steps: int
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "input.txt").write_text(CORPUS_SAMPLE.read_text()[:4000])
    mp.spawn(_worker, args=(world, str(tmp_path), str(data_dir), flags, steps), nprocs=world)
    out = torch.load(tmp_path / "out.pt")
    found, expected = out["found"], out["expected"]
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        error = float((found[name] - tensor).norm() / tensor.norm())
        assert error <= tolerance, (name, error)
    ddp_scaler, sharded_scaler = out["scalers"]
    assert sharded_scaler == ddp_scaler  # the same steps skipped, the same scale
    assert ddp_scaler is None or ddp_scaler["scale"] < 2.0**16  # some were skipped
    sharded_eval, ddp_eval = out["evals"]
    assert sharded_eval is not None and sharded_eval == pytest.approx(ddp_eval, rel=tolerance)


def test_the_optimizer_follows_the_shards_with_its_groups_and_schedule(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "input.txt").write_text(CORPUS_SAMPLE.read_text()[:4000])
    with one_process_world():
        ddp = harness(tmp_path / "ddp", data_dir, tiny=TINY).trainer
        sharded = harness(tmp_path / "fsdp2", data_dir, "--parallelism=fsdp2", tiny=TINY).trainer
        params = {id(p) for p in sharded.model.parameters()}
        groups = sharded.optimizer.param_groups
        assert [len(g["params"]) for g in groups] == [
            len(g["params"]) for g in ddp.optimizer.param_groups
        ]
        assert all(isinstance(p, DTensor) and id(p) in params for g in groups for p in g["params"])
        assert sum(len(g["params"]) for g in groups) == len(params)  # the tied one once
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        assert hyper == [
            {k: v for k, v in g.items() if k != "params"} for g in ddp.optimizer.param_groups
        ]
        assert sharded.scheduler is not None and sharded.scheduler.optimizer is sharded.optimizer
        # The same init as init_weights on the whole model, seeded alike.
        torch.manual_seed(ddp.cfg.run.seed)
        init_weights(ddp.model)
        for name, param in sharded.model.named_parameters():
            assert torch.equal(param.full_tensor(), dict(ddp.model.named_parameters())[name])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--parallelism", "zero3"],
            r"--parallelism \(or TRAIN_PARALLELISM\) must be one of ddp, fsdp2, got 'zero3'",
        ),
        (
            ["--task=cifar", "--parallelism=fsdp2"],
            r"--parallelism \(or TRAIN_PARALLELISM\) fsdp2: task cifar cannot be sharded .*"
            "use --parallelism ddp",
        ),
    ],
)
def test_bad_combinations_name_the_flag_the_task_and_the_alternative(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config([*REQUIRED, *argv], env={})
    cfg = parse_config([*REQUIRED, "--task=charlm"], env={"TRAIN_PARALLELISM": "fsdp2"})
    assert cfg.run.parallelism == "fsdp2"
    assert parse_config(REQUIRED, env={}).run.parallelism == "ddp"


@pytest.mark.usefixtures("processes")
def test_train_exits_2_with_one_line_for_a_task_that_cannot_be_sharded(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "training.train", "--task=cifar", "--parallelism=fsdp2"]
        + [f"--data-dir={tmp_path}", f"--checkpoint-uri={tmp_path / 'durable'}"],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == BAD_INPUT, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "--parallelism" in line]
    assert len(lines) == 1 and "use --parallelism ddp" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
