"""Randomness keyed by (seed, stream, step, sample index): a sample's draw does not depend on
the batch, the rank or the world size that takes it; vectorized, and traceable by
``torch.compile``."""

from __future__ import annotations

import shutil

import pytest
import torch

from training.api import MicroBatch, keyed_dropout, keyed_uniform
from training.api.keyed_random import keyed_seed, keyed_seeds, splitmix64


def where(indices: list[int], step: int = 7) -> MicroBatch:
    return MicroBatch(torch.tensor(indices), step, 0, 5, torch.device("cpu"))


def test_a_samples_dropout_mask_does_not_depend_on_its_batch() -> None:
    x = torch.ones(3, 5, 7, dtype=torch.float64)
    together = keyed_dropout(x, 0.5, [11, 12, 13], site=2)
    alone = keyed_dropout(x[1:2], 0.5, [12], site=2)
    assert torch.equal(together[1], alone[0])
    assert not torch.equal(together[0], together[1])  # another sample, another mask
    assert not torch.equal(keyed_dropout(x, 0.5, [11, 12, 13], site=3), together)


@pytest.mark.parametrize("position", [0, 17, 63])
def test_a_samples_mask_is_the_same_alone_and_anywhere_in_a_batch_of_64(position: int) -> None:
    sample = 1234
    others = [i for i in range(5000, 5064) if i != 5000 + position][:63]
    indices = others[:position] + [sample] + others[position:]
    x = torch.randn(64, 16, 32, dtype=torch.float64)
    seeds = where(indices).sample_seeds(1)
    batch = keyed_dropout(x, 0.3, seeds, site=4)
    alone = keyed_dropout(x[position : position + 1], 0.3, where([sample]).sample_seeds(1), 4)
    assert torch.equal(batch[position], alone[0])
    assert len({tuple(m.flatten().tolist()) for m in (batch != 0)}) == 64  # 64 masks


def test_a_samples_seed_is_the_same_in_any_micro_batch() -> None:
    together = where([4, 9, 30]).sample_seeds(1)
    assert together.dtype == torch.int64
    assert torch.equal(where([9]).sample_seeds(1), together[1:2])
    assert not torch.equal(where([4, 9, 30], step=8).sample_seeds(1), together)  # a new step
    assert not torch.equal(where([4, 9, 30]).sample_seeds(2), together)  # another stream
    assert all(0 <= s < 2**63 for s in together.tolist())


def test_the_vectorized_seeds_are_the_python_ones_bit_for_bit() -> None:
    indices = [0, 1, 2, 49_999, 2**40 + 3]
    assert where(indices).sample_seeds(3).tolist() == keyed_seeds((5, 3, 7), indices)
    assert keyed_seed((1, 2)) == splitmix64(splitmix64(1) ^ 2) & (2**63 - 1)


def test_the_draws_are_uniform_and_dropout_keeps_one_minus_p() -> None:
    u = keyed_uniform(torch.arange(64), site=0, shape=(4096,), device=torch.device("cpu"))
    assert u.shape == (64, 4096) and float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    counts = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert float((counts - 1 / 16).abs().max()) < 0.003
    # Neighbouring elements and samples are uncorrelated.
    assert (
        abs(float(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]))
        < 0.01
    )
    assert abs(float(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1])) < 0.01
    x = torch.ones(64, 4096)
    kept = float((keyed_dropout(x, 0.25, torch.arange(64), site=1) != 0).float().mean())
    assert abs(kept - 0.75) < 0.005


def _dropout_twice(x: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    return keyed_dropout(keyed_dropout(x, 0.2, seeds, site=0).relu(), 0.4, seeds, site=1)


def test_it_compiles_into_one_graph_with_no_break() -> None:
    """fullgraph=True fails on any graph break: a Python loop over samples, a generator, a
    branch on data. aot_eager traces it without a C++ compiler."""
    x = torch.randn(8, 6, 10, dtype=torch.float64)
    seeds = where(list(range(100, 108))).sample_seeds(1)
    compiled = torch.compile(_dropout_twice, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, seeds), _dropout_twice(x, seeds))
    other = where(list(range(200, 208)), step=9).sample_seeds(1)  # new seeds: no new guard
    assert torch.equal(compiled(x, other), _dropout_twice(x, other))


@pytest.mark.usefixtures("processes")  # inductor runs the C++ compiler
def test_it_compiles_with_inductor_on_the_cpu() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("g++") is None:
        pytest.skip("inductor's CPU backend needs a C++ compiler, and this machine has none")
    x = torch.randn(8, 6, 10)
    seeds = where(list(range(100, 108))).sample_seeds(1)
    compiled = torch.compile(_dropout_twice, fullgraph=True)
    assert torch.equal(compiled(x, seeds) != 0, _dropout_twice(x, seeds) != 0)
    torch.testing.assert_close(compiled(x, seeds), _dropout_twice(x, seeds))


@pytest.mark.usefixtures("processes")  # inductor runs the C++ compiler
def test_a_site_that_is_a_symbolic_int_compiles_with_inductor() -> None:
    """Blocks compiled one by one (``--compile`` under fsdp2) share one code object, so the
    second block's site index makes dynamo trace it as a symbolic int: its hash must not be
    Python arithmetic on 64-bit constants, which inductor cannot print as an index."""
    if shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("g++") is None:
        pytest.skip("inductor's CPU backend needs a C++ compiler, and this machine has none")
    x = torch.randn(8, 6, 10)
    seeds = where(list(range(100, 108))).sample_seeds(1)

    def site_dropout(x: torch.Tensor, seeds: torch.Tensor, site: int) -> torch.Tensor:
        return keyed_dropout(x, 0.3, seeds, 2 * site + 1)

    compiled = torch.compile(site_dropout, dynamic=True, fullgraph=True)
    for site in (0, 3):
        expected = site_dropout(x, seeds, site)
        assert torch.equal(compiled(x, seeds, site) != 0, expected != 0)
        torch.testing.assert_close(compiled(x, seeds, site), expected)
