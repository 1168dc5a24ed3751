"""``--compile`` under ``--parallelism=fsdp2``: the character LM, its blocks compiled one by one
(inductor, on the CPU), on real torchrun agents and a real etcd, in float64. One run: two
nodes, one evicted (SIGTERM) mid-run, the survivor re-formed alone, its worker restarted and
compiling again. No step is lost, counted from every node's own log, and the final parameters
agree with an uncompiled fsdp2 run's.

The tolerance is the exactness tests' 1e-9: inductor fuses and reorders float64 arithmetic,
so a compiled step differs from an eager one by rounding alone (~1e-15, as runs at different
world sizes do), while one step more or less moves a parameter by ~1e-3
(tests/support/exactness.py). The DDP twin, tests/training/loop/test_compile.py, compares a
compiled run with a fault to an uninterrupted compiled one; this one compares it with the
eager run, the stronger claim.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lab.local.etcd_server import EmbeddedEtcd
from tests.support.elastic_cluster import Cluster, max_abs_difference
from tests.support.exactness import TOLERANCE, make_data, run_here
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.storage import FileStore
from training.elastic.exit_codes import OK
from training.records import RESUMED, trained_step

pytestmark = [pytest.mark.usefixtures("torchrun", "training"), pytest.mark.slow]

MAX_STEPS = 10
ARGS = [
    "--task=charlm",
    "--parallelism=fsdp2",
    "--block-size=16",
    "--n-layer=2",  # two blocks: the second makes dynamo trace the block's index as a symbol
    "--n-head=2",
    "--n-embd=16",
    "--dropout=0.2",  # keyed dropout inside the compiled blocks
    "--warmup-steps=4",
    "--decay-steps=10",
    "--global-batch-size=12",
    "--micro-batch-size=4",
    "--dtype=float64",
    f"--max-steps={MAX_STEPS}",
    "--log-every=1",
    "--checkpoint-every-steps=0",  # only the eviction's parts can serve
]


def _parameters(checkpoints: Path, scratch: Path) -> dict[str, torch.Tensor]:
    read = ShardedCheckpoints(FileStore(checkpoints), scratch).read_whole(("model.model.",))
    assert read is not None, f"no sharded checkpoint in {checkpoints}"
    entry, whole = read
    assert entry.step == MAX_STEPS, entry
    return whole


def _completed(cluster: Cluster) -> set[int]:
    """Every step some node's own log says was completed (rank 0's metrics, the others'
    step_completed lines)."""
    return {s for r in cluster.records() if (s := trained_step(r)) is not None}


@pytest.mark.timeout(600)
def test_compiled_blocks_lose_no_step_to_an_eviction_and_match_the_eager_run(
    tmp_path: Path, etcd_server: EmbeddedEtcd
) -> None:
    corpus = make_data("charlm", tmp_path / "corpus")
    _, code = run_here(tmp_path / "eager", corpus, ARGS)
    assert code == OK
    expected = _parameters(tmp_path / "eager" / "durable", tmp_path / "scratch-eager")

    cache = tmp_path / "inductor"  # the workers' own: what inductor wrote shows it compiled
    (tmp_path / "cluster").mkdir()
    cluster = Cluster(tmp_path / "cluster", etcd_server.client_port, corpus, max_nodes=2)
    paced = [*ARGS, "--compile=true", "--min-step-time-s=0.5"]
    try:
        for node in ("a", "b"):
            cluster.start(node, paced, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
        cluster.wait_until(lambda: cluster.steps_at(2) >= 3, 300, "3 compiled steps at world 2")
        evicted_ts = max(r["ts"] for r in cluster.records())
        cluster.evict("b")
        assert cluster.wait_exit("a", 240) == 0, cluster.tail()
    finally:
        cluster.close()
    resumed = [e for e in cluster.events(RESUMED) if e["ts"] > evicted_ts][0]
    assert (resumed["world_size"], resumed["source"], resumed["lost_steps"]) == (1, "parts", 0)
    assert set(range(1, MAX_STEPS + 1)) <= _completed(cluster)
    assert any(cache.rglob("*.so")), f"inductor compiled nothing into {cache}"
    final = _parameters(cluster.checkpoints, tmp_path / "scratch")
    assert max_abs_difference(final, expected) < TOLERANCE
