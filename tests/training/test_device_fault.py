"""A fault of one node's GPU replaces that node, not the job: real agents on a real etcd, the
fault raised on the CPU by the nodes' task (tests/support/faulty_device_task.py) as torch raises
an ECC error."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.local.etcd_server import EmbeddedEtcd
from tests.support.elastic_cluster import TINY, Cluster
from tests.support.faulty_device_task import FAULTY_DEVICE_ENV, TASK
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.exit_codes import RETRY_ME
from training.records import RESUMED

pytestmark = [pytest.mark.slow]

ARGS = [*TINY, f"--task={TASK}", "--max-steps=28", "--log-every=1", "--checkpoint-every-steps=4"]
FAILS_AT = 6


@pytest.mark.timeout(300)
def test_a_node_whose_gpu_fails_leaves_and_the_others_train_on(
    tmp_path: Path, etcd_server: EmbeddedEtcd
) -> None:
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=480, test_records=48, seed=1)
    # Two restarts: enough for one lost peer, too few to outlast a node that rejoins and
    # fails again on every restart (which would spend them, and fail the job).
    cluster = Cluster(tmp_path / "run", etcd_server.client_port, data, max_restarts=2)
    cluster.root.mkdir()
    try:
        cluster.start("a", ARGS)
        cluster.start("b", ARGS)
        cluster.start("c", ARGS, env={FAULTY_DEVICE_ENV: str(FAILS_AT)})
        assert cluster.wait_exit("c", 180) == RETRY_ME, cluster.tail()
        for node in ("a", "b"):
            assert cluster.wait_exit(node, 180) == 0, cluster.tail()
        c_log = (cluster.root / "c.err").read_text()
        # Its workers ran on the bad GPU once: no restart on it, and the agent said why.
        assert c_log.count("a fault of this node's GPU: CUDA error: uncorrectable ECC") == 1
        assert "leaving the rendezvous, exiting 138 for a new pod" in c_log
        # The others' round without c, once c had joined. (On a loaded machine c may join only
        # after a and b trained past FAILS_AT: that resume, at world 3, is its join.)
        joined = min(r["ts"] for r in cluster.records("c"))
        resumed = [e for e in cluster.events(RESUMED) if e["ts"] > joined]
        # Under load c may form its first round with one of the others, at world 2 too.
        c_rounds = {r.get("rdzv_round") for r in cluster.records("c")}
        without_c = [e for e in resumed if e["world_size"] == 2 and e["rdzv_round"] not in c_rounds]
        assert without_c and without_c[0]["lost_steps"] == 0, resumed
        assert cluster.max_step() == 28
    finally:
        cluster.close()
