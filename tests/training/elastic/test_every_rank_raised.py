"""Exit 1 is for an error every rank reproduces: two real gloo ranks say whether they both
raised it, and a rank whose peer is still training finds out within the timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.local.etcd_server import free_port

REPO = Path(__file__).resolve().parents[3]

RANK = """
import os, sys
import torch, torch.distributed as dist
from training.elastic.faults import every_rank_raised

rank, scenario, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
if scenario == "one" and rank == 1:
    try:  # still training: the gradient all-reduce waits for rank 0
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        print("peer left", flush=True)
    os._exit(0)
error = KeyError("k") if scenario == "two-classes" and rank == 1 else ValueError("v")
print(every_rank_raised(error, group, timeout_s=3.0), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize(
    ("scenario", "said"),
    [
        ("both", ["True", "True"]),  # a task's bug: every rank raised it, exit 1
        ("two-classes", ["False", "False"]),
        ("one", ["False", "peer left"]),  # rank 0's alone: its peer waited in a collective
    ],
)
@pytest.mark.usefixtures("processes")
def test_every_rank_raised_tells_a_shared_error_from_one_ranks(
    scenario: str, said: list[str]
) -> None:
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), scenario, port],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=120) for p in ranks]
    assert [out.strip() for out, _ in outputs] == said, [err[-1500:] for _, err in outputs]
