"""``--init-from`` under ``--parallelism=fsdp2``: a sharded run at world size 3 (uneven shards:
16, 16 and 14 of the 46 token rows, 6, 6 and 4 of 16) starts from a DDP run's checkpoint
and from a sharded run's saved at world size 1 (resharded), float64.
The parameters its first step starts from are the source's weights, exactly; the optimizer is
fresh, the step 0; and the run trains on from them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.elastic_cluster import final_parameters
from tests.support.exactness import flags, make_data, run_here
from tests.support.trainer_harness import harness
from tests.support.waiting import gloo_group
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.storage import FileStore
from training.elastic.exit_codes import OK
from training.loop.config import ConfigError
from training.loop.dist import DistEnv, new_checkpoint_group
from training.loop.metrics import Phases
from training.records import INITIALIZED

WORLD = 3
ARGS = flags("charlm", "--n-layer=2", "--dropout=0.1")
"""Float64 (``GLOBAL_BATCH`` of tests/support/exactness.py), a tiny charlm."""


def _worker(rank: int, root: str, data: str, sources: dict[str, str]) -> None:
    base = Path(root)
    base.mkdir(exist_ok=True)
    with gloo_group(base / "init", rank, WORLD):
        found: dict[str, object] = {}
        for kind, uri in sources.items():
            args = [*ARGS, "--parallelism=fsdp2", f"--init-from={uri}", "--max-steps=2"]
            env = DistEnv(rank=rank, world_size=WORLD, group_rank=rank, run_id=kind)
            group = new_checkpoint_group(60)
            node = base / kind / f"node{rank}"
            durable = FileStore(base / kind / "durable")
            h = harness(node, Path(data), *args, tiny=(), store=durable, env=env, group=group)
            h.trainer.restore()
            weights = {n: p.full_tensor() for n, p in h.trainer.model.named_parameters()}
            fresh = (h.trainer.state.step, len(h.trainer.optimizer.state))
            # Then a run: it restores (nothing of its own yet: the source again) and trains.
            again = harness(node, Path(data), *args, tiny=(), store=durable, env=env, group=group)
            code = again.trainer.run(SimpleNamespace(requested=False, at=None), Phases())
            initialized = again.events(INITIALIZED) + h.events(INITIALIZED)
            found[kind] = (weights, fresh, code, initialized)
        if rank == 0:
            torch.save(found, base / "found.pt")


@pytest.mark.usefixtures("processes", "training")
@pytest.mark.timeout(300)
def test_a_sharded_run_starts_from_a_ddp_and_a_resharded_checkpoint_exactly(
    tmp_path: Path,
) -> None:
    data = make_data("charlm", tmp_path / "data")
    assert run_here(tmp_path / "ddp", data, [*ARGS, "--max-steps=3"])[1] == OK
    sharded = [*ARGS, "--parallelism=fsdp2", "--max-steps=4"]  # saved at world size 1
    assert run_here(tmp_path / "fsdp2", data, sharded)[1] == OK
    ddp_weights = _weights(final_parameters(tmp_path / "ddp" / "durable"))
    read = ShardedCheckpoints(FileStore(tmp_path / "fsdp2" / "durable"), tmp_path / "s").read_whole(
        "model.model."
    )
    assert read is not None
    fsdp2_weights = {k.removeprefix("model.model."): v for k, v in read[1].items()}
    expected = {"ddp": (ddp_weights, 3), "fsdp2": (fsdp2_weights, 4)}
    sources = {kind: str(tmp_path / kind / "durable") for kind in expected}
    mp.spawn(_worker, args=(str(tmp_path / "new"), str(data), sources), nprocs=WORLD, join=True)
    found = torch.load(tmp_path / "new" / "found.pt", weights_only=False)
    for kind, (source, step) in expected.items():
        weights, fresh, code, initialized = found[kind]
        assert weights and weights.keys() <= source.keys(), kind
        for name, value in weights.items():
            assert value.dtype == torch.float64 and torch.equal(value, source[name]), (kind, name)
        assert fresh == (0, 0), (kind, fresh)  # step 0, an optimizer with no state
        assert code == OK, kind
        assert [e["from_step"] for e in initialized] == [step, step], (kind, initialized)


@pytest.mark.usefixtures("training")
@pytest.mark.parametrize("source", ["ddp", "fsdp2"])
def test_a_source_of_another_shape_is_one_line(tmp_path: Path, source: str) -> None:
    data = make_data("charlm", tmp_path / "data")
    made = [*ARGS, f"--parallelism={source}", "--max-steps=1"]
    assert run_here(tmp_path / "source", data, made)[1] == OK
    args = [*ARGS, "--parallelism=fsdp2", "--n-embd=32"]
    with pytest.raises(ConfigError) as refused:
        run_here(tmp_path / "new", data, [*args, f"--init-from={tmp_path / 'source' / 'durable'}"])
    message = str(refused.value)
    assert "its model does not fit this task's" in message and "\n" not in message, message


def _weights(parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's model parameters by the model's own names."""
    prefix = "model.model."
    return {k.removeprefix(prefix): v for k, v in parameters.items() if k.startswith(prefix)}
