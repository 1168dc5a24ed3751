"""The model: shape, per-sample independence, determinism, and that it learns synthetic data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.data.cifar10 import batch_tensors, load_cifar10_binary, write_synthetic_cifar10
from training.data.sampler import ElasticSampler
from training.tasks.resnet import ModelConfig, build_model, parameter_count


def _model(seed: int = 0, **overrides: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(**({"width": 8, "blocks_per_stage": 1} | overrides)))


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("width", 0, "model width must be an integer >= 1, got 0"),
        ("blocks_per_stage", 0, "model blocks_per_stage must be an integer >= 1, got 0"),
        ("num_classes", 1, "model num_classes must be an integer >= 2, got 1"),
        ("width", 8.0, "model width must be an integer >= 1, got 8.0"),
    ],
)
def test_config_errors_name_the_field(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_model(ModelConfig(**{field: value}))


def test_output_shape_stages_and_parameter_count() -> None:
    model = _model(width=4, blocks_per_stage=2, num_classes=7)
    assert model(torch.randn(5, 3, 32, 32)).shape == (5, 7)
    features = model.stages(model.stem(torch.randn(2, 3, 32, 32)))
    assert features.shape == (2, 16, 8, 8)  # 4w channels after two stride-2 stages
    assert len(model.stages) == 6
    assert parameter_count(model) == sum(p.numel() for p in model.parameters())
    assert parameter_count(model) > parameter_count(_model(width=4, blocks_per_stage=1))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "GroupNorm" in kinds
    assert not kinds & {"BatchNorm2d", "Dropout", "SyncBatchNorm"}


def test_default_config_builds() -> None:
    model = build_model(ModelConfig())
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_a_sample_gets_the_same_output_in_any_batch() -> None:
    model = _model()
    model.train()  # no batch statistics even in training mode
    x = torch.randn(8, 3, 32, 32)
    batched = model(x)
    for i in range(8):
        torch.testing.assert_close(model(x[i : i + 1])[0], batched[i], rtol=1e-4, atol=1e-5)


def test_initial_weights_come_from_the_seed() -> None:
    a, b, c = _model(seed=1).state_dict(), _model(seed=1).state_dict(), _model(seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.usefixtures("training")
def test_loss_falls_on_synthetic_data(tmp_path: Path) -> None:
    write_synthetic_cifar10(tmp_path, train_records=1000, test_records=10, seed=0)
    ds = load_cifar10_binary(tmp_path)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    sampler = ElasticSampler(len(ds), global_batch=32, seed=0)
    losses = []
    for step in range(40):
        x, y = batch_tensors(ds, sampler.global_indices(step), seed=0, epoch=sampler.epoch_of(step))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 2.2  # near ln(10): it starts by guessing
    assert last < first - 0.1
