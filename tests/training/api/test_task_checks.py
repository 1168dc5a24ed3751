"""The API's checks catch a task that would break exact resume: state kept outside the
checkpoint (a scheduler the loop was not given, a private RNG) and randomness from torch's
per-rank global RNG. Each variant below is the character LM changed in one way a port
commonly goes wrong; with the check off, the same variant's resumed run indeed leaves the
uninterrupted one, so the check catches a real break, not a difference of its own making.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.support.elastic_cluster import final_parameters, max_abs_difference
from tests.support.exactness import flags, make_data, run_here
from tests.support.trainer_harness import durable_head, harness, one_process_world
from training.api import TaskContractError, TrainParts, TrainSpec
from training.elastic.exit_codes import OK
from training.tasks import TASKS

CHARLM = TASKS["charlm"]
# The hidden scheduler steps before the optimizer, as torch warns: the port's mistake.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")


def hidden_scheduler() -> TrainSpec:
    """The scheduler is not handed to the loop; the task steps it once per step itself."""
    held: dict[str, Any] = {"last": None}

    def build(options: Any, data: Any, run: Any) -> TrainParts:
        parts = CHARLM.build(options, data, run)
        held["scheduler"], parts.scheduler = parts.scheduler, None
        return parts

    def loss(model: Any, batch: Any, where: Any) -> torch.Tensor:
        if where.step != held["last"]:
            held["last"] = where.step
            held["scheduler"].step()
        return CHARLM.loss(model, batch, where)

    return replace(CHARLM, build=build, loss=loss)


def private_generator() -> TrainSpec:
    """Input noise drawn from a generator the task keeps: its position is not in the state."""
    generator = torch.Generator().manual_seed(0)

    def loss(model: Any, batch: dict[str, torch.Tensor], where: Any) -> Any:
        windows = batch["windows"]
        noisy = torch.rand(windows.shape, generator=generator) < 0.1
        return CHARLM.loss(model, {**batch, "windows": torch.where(noisy, 0, windows)}, where)

    return replace(CHARLM, loss=loss)


def global_rng() -> TrainSpec:
    """Dropout on the logits from torch's global RNG, as ``nn.Dropout`` draws it."""

    def loss(model: Any, batch: dict[str, torch.Tensor], where: Any) -> torch.Tensor:
        windows = batch["windows"]
        logits = F.dropout(model(windows[:, :-1]), 0.1, training=True)
        return F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="sum")

    return replace(CHARLM, loss=loss)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data("charlm", tmp_path_factory.mktemp("data") / "charlm")


@pytest.mark.parametrize(
    ("variant", "seen"),
    [(hidden_scheduler, "learning rates"), (private_generator, "loss")],
)
def test_state_kept_outside_the_checkpoint_is_refused_before_training(
    variant: Callable[[], TrainSpec], seen: str, data: Path, tmp_path: Path
) -> None:
    with pytest.raises(TaskContractError, match=f"keeps state outside the checkpoint.*{seen}"):
        run_here(tmp_path, data, flags("charlm", "--max-steps=3"), spec=variant())
    assert durable_head(tmp_path / "durable") is None


@pytest.mark.parametrize("variant", [hidden_scheduler, private_generator])
def test_unchecked_that_state_does_break_the_resumed_trajectory(
    variant: Callable[[], TrainSpec], data: Path, tmp_path: Path
) -> None:
    unchecked = flags("charlm", "--resume-check=false")
    whole, code = run_here(tmp_path / "whole", data, [*unchecked, "--max-steps=6"], spec=variant())
    assert code == OK
    for steps in (3, 6):  # stopped at 3, resumed in a new process (a new task object)
        _, code = run_here(
            tmp_path / "split", data, [*unchecked, f"--max-steps={steps}"], spec=variant()
        )
        assert code == OK
    difference = max_abs_difference(
        final_parameters(tmp_path / "split" / "durable"),
        final_parameters(tmp_path / "whole" / "durable"),
    )
    assert difference > 1e-6


def test_randomness_from_the_global_rng_is_refused_at_the_first_micro_batch(
    data: Path, tmp_path: Path
) -> None:
    with pytest.raises(TaskContractError, match="drew from torch's global RNG in its loss"):
        run_here(tmp_path, data, flags("charlm", "--max-steps=3"), spec=global_rng())
    # The same check guards every step, not only the rehearsal before the first.
    with pytest.raises(TaskContractError, match="global RNG"):
        run_here(
            tmp_path,
            data,
            flags("charlm", "--max-steps=3", "--resume-check=false"),
            spec=global_rng(),
        )


def per_sample(model: Any, batch: Any, where: Any) -> Any:
    total, count = CHARLM.loss(model, batch, where)
    return total.expand(2), count


def negative_count(model: Any, batch: Any, where: Any) -> Any:
    total, count = CHARLM.loss(model, batch, where)
    return total, -count


def three_values(model: Any, batch: Any, where: Any) -> Any:
    return (*CHARLM.loss(model, batch, where), 1)


@pytest.mark.parametrize(
    ("loss", "seen"),
    [
        (per_sample, r"got \(Tensor \(2,\), Tensor \(\)\)"),
        (negative_count, r"got \(Tensor \(\), Tensor \(\)\)"),
        (three_values, r"got \(Tensor \(\), Tensor \(\), int\)"),
    ],
)
def test_a_loss_that_is_not_a_scalar_or_a_sum_and_count_is_refused(
    loss: Callable[..., Any], seen: str, data: Path, tmp_path: Path
) -> None:
    with pytest.raises(TaskContractError, match=f"loss must return a scalar tensor .*{seen}"):
        run_here(tmp_path, data, flags("charlm", "--max-steps=1"), spec=replace(CHARLM, loss=loss))


def test_the_real_tasks_pass_the_checks(data: Path, tmp_path: Path) -> None:
    _, code = run_here(tmp_path, data, flags("charlm", "--max-steps=2", "--dropout=0.5"))
    assert code == OK


def _small_state_bytes(tmp_path: Path, data: Path, width: int) -> tuple[int, int]:
    """(bytes of tensors the resume check copies, bytes of the parameters) at ``width``."""
    with one_process_world():
        h = harness(tmp_path / str(width), data, *flags("charlm", f"--n-embd={width}"), tiny=())
        small = h.trainer.small_state()
        copied = [t for t in small["rng"].values()] + list(small["buffers"].values())
        params = sum(p.numel() * p.element_size() for p in h.trainer.model.parameters())
        return sum(t.numel() * t.element_size() for t in copied), params


def test_the_resume_check_copies_nothing_that_grows_with_the_model(
    data: Path, tmp_path: Path
) -> None:
    small_copied, small_params = _small_state_bytes(tmp_path, data, 16)
    large_copied, large_params = _small_state_bytes(tmp_path, data, 64)
    assert large_params > 8 * small_params
    assert large_copied == small_copied
