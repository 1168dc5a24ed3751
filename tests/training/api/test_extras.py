"""A task's extras (``TrainParts.extras``): the EMA's arithmetic, and the names the loop
accepts. Their exactness under faults is in tests/training/test_elastic_training_charlm.py
(DDP) and test_elastic_training_fsdp2.py (sharded), which train charlm with --ema-decay."""

from __future__ import annotations

import pytest
import torch

from training.api import EMA, TaskContractError
from training.api.spec import checked_extras


def test_the_ema_starts_at_the_parameters_and_follows_each_step() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = EMA(0.75)
    ema.attach(model)
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.update(model)
    assert torch.allclose(ema.shadow["weight"], torch.full((1, 2), 1.5))  # 0.75*1 + 0.25*3
    restored = EMA(0.75)
    restored.attach(torch.nn.Linear(2, 1, bias=False))
    restored.load_state_dict(ema.state_dict())
    assert torch.equal(restored.shadow["weight"], ema.shadow["weight"])


def test_a_decay_outside_0_1_is_refused() -> None:
    for decay in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="decay must be in"):
            EMA(decay)


def test_an_extra_named_like_the_loops_own_state_is_refused() -> None:
    with pytest.raises(TaskContractError, match="'scaler'"):
        checked_extras("mine", {"scaler": EMA(0.5)})
    with pytest.raises(TaskContractError, match="identifier"):
        checked_extras("mine", {"my ema": EMA(0.5)})
    assert list(checked_extras("mine", {"ema": EMA(0.5)})) == ["ema"]
