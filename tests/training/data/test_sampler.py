"""The sampler: sharding arithmetic, determinism, resume at any world size, loss scaling."""

from __future__ import annotations

import re

import pytest
import torch

from training.data.sampler import (
    ElasticSampler,
    epoch_permutation,
    loss_scale,
    micro_batches,
    rank_share,
    steps_per_epoch,
)
from training.tasks.resnet import ModelConfig, build_model


def _sampler(**overrides: int) -> ElasticSampler:
    fields = {"num_samples": 103, "global_batch": 10, "seed": 7} | overrides
    return ElasticSampler(**fields)


def test_rank_shares_cover_the_global_batch_once_in_rank_order() -> None:
    for global_batch in range(1, 65):
        for world_size in range(1, global_batch + 1):
            shares = [rank_share(global_batch, world_size, r) for r in range(world_size)]
            counts = [count for _, count in shares]
            assert shares[0][0] == 0
            for (start, count), (next_start, _) in zip(shares, shares[1:], strict=False):
                assert next_start == start + count  # contiguous, rank order
            assert sum(counts) == global_batch
            assert max(counts) - min(counts) <= 1
            assert counts == sorted(counts, reverse=True)  # remainder to the lowest ranks


def test_rank_share_examples() -> None:
    assert [rank_share(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert rank_share(8, 8, 7) == (7, 1)


@pytest.mark.parametrize(
    ("global_batch", "world_size", "rank", "needle"),
    [
        (4, 5, 0, "world_size (5) must be <= global_batch (4)"),
        (8, 2, 2, "rank must be in 0..1"),
        (8, 2, -1, "rank must be in 0..1"),
        (8, 0, 0, "world_size must be an integer >= 1"),
        (0, 1, 0, "global_batch must be an integer >= 1"),
    ],
)
def test_rank_share_rejects(global_batch: int, world_size: int, rank: int, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        rank_share(global_batch, world_size, rank)


def test_steps_per_epoch_drops_the_partial_batch() -> None:
    assert steps_per_epoch(103, 10) == 10
    assert steps_per_epoch(100, 10) == 10
    assert steps_per_epoch(10, 10) == 1
    with pytest.raises(ValueError, match="num_samples \\(9\\) must be >= global_batch \\(10\\)"):
        steps_per_epoch(9, 10)


def test_epoch_permutation_is_a_deterministic_permutation() -> None:
    perm = epoch_permutation(1000, seed=3, epoch=2)
    assert torch.equal(perm.sort().values, torch.arange(1000))
    assert torch.equal(perm, epoch_permutation(1000, seed=3, epoch=2))
    assert not torch.equal(perm, epoch_permutation(1000, seed=3, epoch=3))
    assert not torch.equal(perm, epoch_permutation(1000, seed=4, epoch=2))
    # Seed and epoch are mixed, not added: (1, 0) is not (0, 1).
    assert not torch.equal(epoch_permutation(1000, 1, 0), epoch_permutation(1000, 0, 1))


def test_epoch_permutation_result_can_be_written_without_changing_later_calls() -> None:
    perm = epoch_permutation(50, seed=0, epoch=0)
    expected = perm.clone()
    perm.zero_()
    assert torch.equal(epoch_permutation(50, seed=0, epoch=0), expected)


def test_global_batch_is_the_same_at_every_world_size() -> None:
    sampler = _sampler()
    for step in range(25):
        expected = sampler.global_indices(step)
        assert expected.shape == (10,)
        for world_size in (1, 2, 3, 4, 7, 10):
            shards = [sampler.rank_indices(step, world_size, r) for r in range(world_size)]
            assert torch.equal(torch.cat(shards), expected)


def test_an_epoch_visits_distinct_samples_then_the_next_epoch_reshuffles() -> None:
    sampler = _sampler()
    spe = sampler.steps_per_epoch
    epoch0 = torch.cat([sampler.global_indices(s) for s in range(spe)])
    assert epoch0.unique().numel() == spe * 10  # no sample twice within an epoch
    assert torch.equal(epoch0, epoch_permutation(103, 7, 0)[: spe * 10])
    assert sampler.epoch_of(spe - 1) == 0
    assert sampler.epoch_of(spe) == 1
    assert torch.equal(sampler.global_indices(spe), epoch_permutation(103, 7, 1)[:10])
    assert torch.equal(sampler.global_indices(3 * spe + 2), epoch_permutation(103, 7, 3)[20:30])


def test_resume_with_changing_world_size_replays_the_same_samples() -> None:
    # One run trains steps 0..29 alone; another is evicted and rescaled every few steps and
    # restarted from a fresh sampler each time: only the step carries over.
    reference = [_sampler().global_indices(step) for step in range(30)]
    world_sizes = [3] * 7 + [2] * 5 + [4] * 11 + [1] * 7
    for step, world_size in enumerate(world_sizes):
        resumed = _sampler()
        shards = [resumed.rank_indices(step, world_size, r) for r in range(world_size)]
        assert torch.equal(torch.cat(shards), reference[step])


def test_consumed_samples_and_state() -> None:
    sampler = _sampler()
    assert sampler.consumed_samples(0) == 0
    assert sampler.consumed_samples(13) == 130
    assert sampler.state_dict() == {"num_samples": 103, "global_batch": 10, "seed": 7}
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        sampler.global_indices(-1)
    with pytest.raises(ValueError, match="num_samples \\(5\\) must be >= global_batch"):
        _sampler(num_samples=5)


def test_micro_batches_cover_a_share() -> None:
    assert micro_batches(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert micro_batches(8, 8) == [(0, 8)]
    assert micro_batches(3, 16) == [(0, 3)]
    assert micro_batches(0, 4) == []
    for count in range(1, 40):
        for size in range(1, 12):
            chunks = micro_batches(count, size)
            assert sum(n for _, n in chunks) == count
            assert all(off == i * size for i, (off, _) in enumerate(chunks))
            assert all(n == size for _, n in chunks[:-1])
    with pytest.raises(ValueError, match="micro_batch_size must be an integer >= 1"):
        micro_batches(4, 0)


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _ddp_gradient(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    world_size: int,
    *,
    scaled_sum: bool,
    micro_batch_size: int,
) -> torch.Tensor:
    """What DDP computes: each rank backprops its share (in micro-batches), then the mean."""
    per_rank = []
    for rank in range(world_size):
        start, count = rank_share(len(y), world_size, rank)
        model.zero_grad()
        for offset, size in micro_batches(count, micro_batch_size):
            part = slice(start + offset, start + offset + size)
            summed = torch.nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum")
            # scaled_sum=False is the naive per-rank mean.
            scale = loss_scale(count, world_size, len(y)) if scaled_sum else 1 / count
            loss = summed * scale
            loss.backward()
        per_rank.append(_flat_grad(model))
    return torch.stack(per_rank).mean(dim=0)


def test_loss_scale_makes_averaged_rank_gradients_equal_the_global_mean_gradient() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(width=4, blocks_per_stage=1)).double()
    x = torch.randn(10, 3, 32, 32, dtype=torch.float64)
    y = torch.arange(10) % 10
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = _flat_grad(model)
    for world_size, micro in ((1, 10), (3, 10), (3, 2), (4, 1), (7, 3), (10, 1)):
        got = _ddp_gradient(model, x, y, world_size, scaled_sum=True, micro_batch_size=micro)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    # The per-rank mean is wrong when shares are uneven (10 over 3 ranks: 4, 3, 3).
    naive = _ddp_gradient(model, x, y, 3, scaled_sum=False, micro_batch_size=10)
    assert not torch.allclose(naive, expected, rtol=1e-6, atol=1e-9)


def test_loss_scale_value_and_errors() -> None:
    assert loss_scale(4, 3, 10) == pytest.approx(0.3)
    assert loss_scale(64, 1, 64) == pytest.approx(1 / 64)
    with pytest.raises(ValueError, match="count must be in 1..10"):
        loss_scale(0, 3, 10)
    with pytest.raises(ValueError, match="world_size \\(11\\) must be <= global_batch \\(10\\)"):
        loss_scale(1, 11, 10)
