"""Randomness keyed by (seed, stream, step, sample index): a sample's draw does not depend on
the batch, the rank or the world size that takes it."""

from __future__ import annotations

import torch

from training.api import MicroBatch, keyed_dropout


def test_a_samples_dropout_mask_does_not_depend_on_its_batch() -> None:
    x = torch.ones(3, 5, 7, dtype=torch.float64)
    together = keyed_dropout(x, 0.5, [11, 12, 13], site=2)
    alone = keyed_dropout(x[1:2], 0.5, [12], site=2)
    assert torch.equal(together[1], alone[0])
    assert not torch.equal(together[0], together[1])  # another sample, another mask
    assert not torch.equal(keyed_dropout(x, 0.5, [11, 12, 13], site=3), together)


def test_a_samples_seed_is_the_same_in_any_micro_batch() -> None:
    def where(indices: list[int], step: int = 7) -> MicroBatch:
        return MicroBatch(torch.tensor(indices), step, 0, 5, torch.device("cpu"))

    together = where([4, 9, 30]).sample_seeds(1)
    assert where([9]).sample_seeds(1) == together[1:2]
    assert where([4, 9, 30], step=8).sample_seeds(1) != together  # a new step, new draws
    assert where([4, 9, 30]).sample_seeds(2) != together  # another stream
    assert all(0 <= s < 2**63 for s in together)
