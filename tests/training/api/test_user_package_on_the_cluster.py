"""The user's own package (tests/support/user_package) through a worker pod's own start path:
``python -m training.agent`` on two nodes, each copying the dataset (``points.pt`` and a nested
file, under their completion marker) from a directory as the pod's mount shows it, then training
under torchrun's agent on a real etcd, with DDP and with fsdp2. ``lab export`` then writes each
run's model, which loads into a fresh model with the keys, shapes and values rank 0 held at the
end (under fsdp2 gathered with ``full_tensor``); and with every node's stdout gone, ``lab report
--stack`` rebuilds the run's report from the records the workers stored beside the checkpoints.

The workers train ``probe:spec``: the package's own spec, whose evaluation at the last step
also saves rank 0's model (the reference), so nothing in the product knows of the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from lab.cli import main
from lab.local.etcd_server import EmbeddedEtcd
from lab.local.process_tree import kill_tree
from tests.support.elastic_cluster import REPO, WHOLE_FIRST_ROUND
from tests.support.lab_azure_fixtures import fake_pulumi
from tests.support.user_package import NESTED, POINTS, write_user_data, write_user_package
from training.data.dataset_marker import MARKER, local_file, marker_body
from training.elastic.launch import ElasticPolicy, train_command, worker_env

pytestmark = [pytest.mark.usefixtures("torchrun"), pytest.mark.slow]

STEPS = 4
PROBE = '''
"""The package's spec, whose evaluation at the last step saves rank 0's whole model."""

import dataclasses
import os

import torch

from mytask import model

def evaluate(module, data, ctx):
    result = model.evaluate(module, data, ctx)
    whole = {
        name.removeprefix("module."): getattr(value, "full_tensor", lambda: value)().clone()
        for name, value in module.state_dict().items()
    }  # full_tensor on every rank: it gathers the shards
    if ctx.rank == 0:
        torch.save(whole, os.environ["PROBE_OUT"])
    return result

spec = dataclasses.replace(model.spec, evaluate=evaluate)
'''


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the package's directory, the data source as the pod's read-only mount shows it)."""
    root = tmp_path_factory.mktemp("user")
    src = write_user_package(root / "src")
    (src / "probe.py").write_text(PROBE)
    mount = write_user_data(root / "mnt")
    listed = [local_file(mount, mount / p) for p in (POINTS, NESTED)]
    (mount / MARKER).write_bytes(marker_body(listed, source="lab data upload"))
    return src, mount


def _train(root: Path, package: tuple[Path, Path], etcd: EmbeddedEtcd, parallelism: str) -> Path:
    """Two nodes as two pods run them; the checkpoint directory once both finished."""
    src, mount = package
    policy = ElasticPolicy(
        rdzv_host="127.0.0.1",
        rdzv_port=etcd.client_port,
        rdzv_id=f"user-{uuid.uuid4().hex[:8]}",
        min_nodes=2,
        max_nodes=2,
        max_restarts=3,
        nproc_per_node=1,
        rendezvous=WHOLE_FIRST_ROUND,
    )
    checkpoints = root / "checkpoints"
    args = [
        "--task=probe:spec", f"--parallelism={parallelism}", "--width=6", f"--max-steps={STEPS}",
        f"--eval-every={STEPS}", "--global-batch-size=8", "--micro-batch-size=4",
        f"--checkpoint-every-steps={STEPS}", "--log-every=1",
    ]  # fmt: skip
    nodes = {}
    for name in ("worker-0", "worker-1"):
        env = {
            **os.environ,
            **policy.pet_env(),
            **worker_env(
                checkpoint_uri=str(checkpoints),
                local_dir=str(root / f"local-{name}"),
                collective_timeout_s=30,
            ),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(src)]),
            # What the job's pod spec sets: the mount, the pod's disk, the pod's name.
            "TRAIN_DATA_URI": str(mount),
            "TRAIN_DATA_DIR": str(root / f"data-{name}"),
            "TRAIN_NODE_NAME": name,
            "TRAIN_RECORDS_URI": str(checkpoints / "records"),
            "PROBE_OUT": str(root / "rank0.pt"),
        }
        with open(root / f"{name}.out", "wb") as out, open(root / f"{name}.err", "wb") as err:
            nodes[name] = subprocess.Popen(
                train_command(args, sys.executable), env=env, cwd=REPO, stdout=out, stderr=err,
                start_new_session=True,
            )  # fmt: skip
    try:
        codes = {name: node.wait(300) for name, node in nodes.items()}
    finally:
        for node in nodes.values():
            if node.poll() is None:
                kill_tree(node.pid)
    tails = "\n".join((root / f"{n}.err").read_text()[-3000:] for n in nodes)
    assert codes == {"worker-0": 0, "worker-1": 0}, tails
    for name in nodes:  # the agent's copy: every file, nested too, under the pod's disk
        copied = root / f"data-{name}"
        assert (copied / POINTS).read_bytes() == (mount / POINTS).read_bytes()
        assert (copied / NESTED).read_bytes() == (mount / NESTED).read_bytes()
    return checkpoints


def _fresh_model(src: Path) -> torch.nn.Module:
    sys.path.insert(0, str(src))
    try:
        from mytask.model import PointsNet

        return PointsNet(6)
    finally:
        sys.path.remove(str(src))


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_the_users_package_trains_on_two_nodes_and_its_model_is_exported(
    parallelism: str,
    package: tuple[Path, Path],
    etcd_server: EmbeddedEtcd,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checkpoints = _train(tmp_path, package, etcd_server, parallelism)
    reference = torch.load(tmp_path / "rank0.pt", weights_only=True)
    out = tmp_path / "model.pt"
    assert main(["export", "--checkpoint-uri", str(checkpoints), "--out", str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    fresh = _fresh_model(package[0])
    fresh.load_state_dict(exported)  # strict: the model's own keys, and its shapes
    assert sorted(exported) == sorted(reference) == sorted(fresh.state_dict())
    for name, value in reference.items():
        assert exported[name].shape == value.shape and torch.equal(exported[name], value), name

    # The pods are gone, and their stdout with them: the report comes from the stored records.
    for node in ("worker-0", "worker-1"):
        (tmp_path / f"{node}.out").unlink()
    bin_dir = fake_pulumi(tmp_path / "bin", {"checkpointUri": str(checkpoints)})
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    report_dir = tmp_path / "report"
    assert main(["report", "--stack", "dev", "--out", str(report_dir)]) == 0
    report = json.loads((report_dir / "report.json").read_text())
    pods = sorted(p.stem for p in (report_dir / "pods").glob("*.log"))
    assert pods == ["worker-0", "worker-1"] and report["source"] == "cluster"
    assert report["run"]["finished"] and report["run"]["final_step"] == STEPS, report["run"]
    assert (report_dir / "timeline.png").exists()
