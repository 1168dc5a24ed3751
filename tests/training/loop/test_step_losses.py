"""A (sum, count) loss: the step's gradient is that of the loss averaged over the global
batch's count, whether the batch is taken by one rank or split over 2 or 3 with
micro-batches of their own (DDP's average over the ranks, then training/loop/step/losses.py).
"""

from __future__ import annotations

import pytest
import torch

from training.api import TaskContractError
from training.loop.step.losses import StepLosses, normalize_gradients, split_loss

LENGTHS = [5, 1, 7, 3, 2, 6, 4]
"""Tokens per sample: variable, so a rank's mean of means would weigh them wrongly."""


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(len(LENGTHS), max(LENGTHS), 3, dtype=torch.float64, generator=generator)
    mask = torch.arange(max(LENGTHS)) < torch.tensor(LENGTHS).unsqueeze(1)
    return inputs, mask


def _loss(weight: torch.Tensor, inputs: torch.Tensor, mask: torch.Tensor) -> tuple:
    per_token = torch.tanh(inputs @ weight) ** 2
    return (per_token * mask).sum(), mask.sum()


def _split_gradient(world: int, micro: int) -> torch.Tensor:
    """Each rank's share in micro-batches of ``micro``, summed unscaled; the ranks' gradients
    averaged as DDP does; the counts all-reduced; the gradient normalized on every rank."""
    inputs, mask = _batch()
    shares = torch.arange(len(LENGTHS)).tensor_split(world)
    ranks = []
    for share in shares:
        weight = torch.nn.Parameter(torch.linspace(-1, 1, 3, dtype=torch.float64))
        losses = StepLosses("toy")
        for chunk in share.split(micro):
            loss, count = split_loss(_loss(weight, inputs[chunk], mask[chunk]))
            loss.backward()
            losses.add(loss, count, len(chunk))
        ranks.append((weight, losses))
    average = sum(w.grad for w, _ in ranks) / world  # DDP's all-reduce
    counts = [losses.count for _, losses in ranks]
    results = []
    for weight, losses in ranks:
        weight.grad = average.clone()
        seen = normalize_gradients([weight], losses, world, lambda t: t.fill_(sum(counts)))
        assert seen == sum(LENGTHS)
        results.append(weight.grad)
    assert all(torch.equal(results[0], r) for r in results)
    return results[0]


def test_the_gradient_is_the_global_count_mean_at_any_world_size() -> None:
    inputs, mask = _batch()
    weight = torch.nn.Parameter(torch.linspace(-1, 1, 3, dtype=torch.float64))
    total, count = _loss(weight, inputs, mask)
    (total / count).backward()
    expected = weight.grad
    for world, micro in [(1, 7), (1, 2), (2, 2), (3, 1), (3, 2)]:
        got = _split_gradient(world, micro)
        assert torch.allclose(got, expected, rtol=1e-12, atol=0), (world, micro)
    # Each rank's own mean, averaged, is another gradient: the normalization is not a no-op.
    means = [_loss(weight, inputs[s], mask[s]) for s in torch.arange(7).tensor_split(2)]
    weight.grad = None
    (sum(t / c for t, c in means) / 2).backward()
    assert not torch.allclose(weight.grad, expected, rtol=1e-6)


def test_a_sum_over_samples_is_left_as_the_loop_scaled_it() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.full((2,), 3.0)
    losses = StepLosses("toy")
    losses.add(torch.tensor(1.5), None, 4)
    assert normalize_gradients([weight], losses, 2, None) == 4  # the samples, for the log
    assert weight.grad.tolist() == [3.0, 3.0]


def test_a_global_count_of_zero_gives_a_zero_gradient() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.zeros(2)
    losses = StepLosses("toy")
    losses.add(torch.tensor(0.0), 0.0, 4)
    assert normalize_gradients([weight], losses, 2, lambda t: t) == 0
    assert weight.grad.tolist() == [0.0, 0.0]


def test_mixing_the_two_kinds_in_a_step_is_refused() -> None:
    losses = StepLosses("toy")
    losses.add(torch.tensor(1.0), 3.0, 2)
    with pytest.raises(TaskContractError, match="task 'toy': loss returned a .sum, count. pair"):
        losses.add(torch.tensor(1.0), None, 2)
