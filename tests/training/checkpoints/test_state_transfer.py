"""A state sent from its holder to the other ranks tensor by tensor: every rank ends with exactly
the holder's state, whatever its tensors (tied, strided, empty, of any dtype, larger than a
bucket), on real gloo process groups; a rank that passes its live state receives into it."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.waiting import gloo_group
from training.checkpoints import state_transfer
from training.checkpoints.serialization import deserialize, serialize
from training.checkpoints.state_transfer import plan, share

BUCKET = 1000  # small, so a test's tensors span buckets and are packed several to one


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    tied = torch.randn(30, 20, generator=generator, dtype=torch.float64)
    model: OrderedDict[str, Any] = OrderedDict(
        [("embed.weight", tied), ("head.weight", tied), ("norm.bias", torch.zeros(5))]
    )
    model._metadata = OrderedDict([("", {"version": 1}), ("norm", {"version": 2})])  # type: ignore[attr-defined]
    return {
        "model": model,
        "optimizer": {
            "state": {
                0: {
                    "step": torch.tensor(3.0),
                    "exp_avg": torch.randn(7, 3, generator=generator).t(),
                },
                1: {"step": torch.tensor(3.0), "big": torch.randn(900, generator=generator)},
            },
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}],
        },
        "rng": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=generator),
        "mask": torch.rand(11, generator=generator) > 0.5,
        "half": torch.randn(9, generator=generator).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "ids": torch.arange(6, dtype=torch.int64),
        "parameter": torch.nn.Parameter(torch.ones(3)),
        "trainer": {"step": 12, "name": "run", "none": None},
    }


def _worker(rank: int, root: str, results: dict) -> None:
    with gloo_group(Path(root) / "init", rank, 2):
        state_transfer.BUCKET_BYTES = BUCKET
        # The holder is rank 1: ``src`` is a global rank, not always 0.
        got = share(
            deserialize(serialize(_state())) if rank == 1 else None, 1, torch.device("cpu"), None
        )
        results[rank] = serialize(got)
        model = got["model"]
        results[f"{rank}-tied"] = model["embed.weight"] is model["head.weight"] or (
            model["embed.weight"].untyped_storage().data_ptr()
            == model["head.weight"].untyped_storage().data_ptr()
        )
        results[f"{rank}-metadata"] = getattr(model, "_metadata", None)


def _live() -> dict[str, Any]:
    """A receiver's own state of the same structure, other values: what ``into`` receives into."""
    tied = torch.zeros(30, 20, dtype=torch.float64)
    return {
        "model": {"embed.weight": tied, "head.weight": tied, "norm.bias": torch.ones(5)},
        "optimizer": {
            "state": {
                0: {"exp_avg": torch.zeros(7, 3).t()},  # strided: no view of its bytes
                1: {"big": torch.zeros(900)},  # larger than a bucket: received in slices
            }
        },
        "half": torch.zeros(9),  # float32, the holder's is bfloat16: not this tensor
        "ids": torch.zeros(5, dtype=torch.int64),  # another shape: not this tensor
        "rng": torch.zeros(13, dtype=torch.uint8),
    }


def _receiving_worker(rank: int, root: str, results: dict) -> None:
    with gloo_group(Path(root) / "init", rank, 2):
        state_transfer.BUCKET_BYTES = BUCKET
        live = _live()
        got = share(_state() if rank == 0 else None, 0, torch.device("cpu"), None, into=live)
        results[rank] = serialize(got)
        if rank == 1:
            paths = {
                "tied": (got["model"]["embed.weight"], live["model"]["embed.weight"]),
                "tied twin": (got["model"]["head.weight"], live["model"]["embed.weight"]),
                "bias": (got["model"]["norm.bias"], live["model"]["norm.bias"]),
                "big": (got["optimizer"]["state"][1]["big"], live["optimizer"]["state"][1]["big"]),
                "rng": (got["rng"], live["rng"]),
                "strided": (got["optimizer"]["state"][0]["exp_avg"], None),
                "dtype": (got["half"], live["half"]),
                "shape": (got["ids"], live["ids"]),
            }
            results["same"] = {k: a is b for k, (a, b) in paths.items() if b is not None}
            results["live"] = serialize(live)


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_a_rank_that_passes_its_live_state_receives_into_its_tensors(tmp_path: Path) -> None:
    """A receiver holds its state once: each tensor that matches (path, dtype, shape, and a
    contiguous layout) is the one the bytes land in; the others are allocated as before."""
    results = mp.Manager().dict()
    mp.spawn(_receiving_worker, args=(str(tmp_path), results), nprocs=2, join=True)
    expected = _state()
    for rank in (0, 1):
        _same(deserialize(results[rank]), expected)
    assert results["same"] == {
        "tied": True,
        "tied twin": True,
        "bias": True,
        "big": True,
        "rng": True,
        "dtype": False,
        "shape": False,
    }
    live = deserialize(results["live"])
    assert torch.equal(live["model"]["embed.weight"], expected["model"]["embed.weight"])
    assert torch.equal(
        live["optimizer"]["state"][1]["big"], expected["optimizer"]["state"][1]["big"]
    )
    assert torch.equal(live["ids"], torch.zeros(5, dtype=torch.int64))  # left alone


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad)
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_every_rank_ends_with_exactly_the_holders_state(tmp_path: Path) -> None:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(str(tmp_path), results), nprocs=2, join=True)
    expected = _state()
    for rank in (0, 1):
        _same(deserialize(results[rank]), expected)
        assert results[f"{rank}-tied"], "tied weights arrived as two tensors"
        assert results[f"{rank}-metadata"] == expected["model"]._metadata


def test_the_plan_packs_small_tensors_and_slices_large_ones() -> None:
    assert plan([300, 0, 500, 300, 2500, 100], bucket=1000) == [
        [(0, 0, 300), (2, 0, 500)],
        [(3, 0, 300)],
        [(4, 0, 1000)],
        [(4, 1000, 2000)],
        [(4, 2000, 2500)],
        [(5, 0, 100)],
    ]
    assert plan([1000, 1000], bucket=1000) == [[(0, 0, 1000)], [(1, 0, 1000)]]
    assert plan([], bucket=1000) == []
