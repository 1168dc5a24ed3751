"""The character LM task: its flags, its data, its schedule, its evaluation lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.elastic_cluster import final_parameters, max_abs_difference
from tests.support.exactness import CORPUS_SAMPLE, flags, make_data, run_here
from training.data.cifar10 import DatasetError
from training.elastic.exit_codes import OK
from training.loop.config import ConfigError, parse_config
from training.loop.inputs import load_data
from training.records import EVALUATED, FINISHED, events_named, read_lines
from training.tasks import TASKS
from training.tasks.charlm import CharLMOptions, warmup_cosine

REQUIRED = ["--data-dir", "/d", "--checkpoint-uri", "/c"]


def test_the_task_brings_its_flags_and_defaults() -> None:
    cfg = parse_config([*REQUIRED, "--task", "charlm", "--n-layer", "2"], env={})
    assert (cfg.run.task, cfg.options.n_layer, cfg.options.block_size) == ("charlm", 2, 64)
    assert (cfg.optim.lr, cfg.run.eval_every) == (1e-3, 50)  # the task's defaults
    cfg = parse_config(REQUIRED, env={"TRAIN_TASK": "charlm", "TRAIN_LR": "0.01"})
    assert (cfg.spec.name, cfg.optim.lr) == ("charlm", 0.01)  # env beats the task's default
    assert parse_config(REQUIRED, env={}).run.task == "cifar"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--task", "gpt5"],
            r"--task \(or TRAIN_TASK\) must be one of charlm, cifar or a TrainSpec of your own "
            r"module as module.path:attribute, got 'gpt5'",
        ),
        (["--task", "charlm", "--n-embd", "30"], "--n-embd .30. must be a multiple of --n-head"),
        (["--task", "charlm", "--dropout", "1"], r"--dropout must be in \[0, 1\), got 1.0"),
        (["--task", "charlm", "--block-size", "0"], "--block-size must be >= 1, got 0"),
        (["--task", "charlm", "--decay-steps", "5"], r"--decay-steps \(5\) must be >= --warmup"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config([*REQUIRED, *argv], env={})


def test_another_tasks_flag_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_config([*REQUIRED, "--task", "charlm", "--model-width", "4"], env={})


def test_a_missing_or_short_corpus_names_the_setting_and_the_file(tmp_path: Path) -> None:
    cfg = parse_config(["--data-dir", str(tmp_path), "--checkpoint-uri", "/c", "--task=charlm"])
    with pytest.raises(DatasetError, match=f"--data-dir .*{tmp_path}: cannot read it: .*input.txt"):
        load_data(cfg)
    (tmp_path / "input.txt").write_text("To be, or not to be")
    with pytest.raises(DatasetError, match="too few for one validation window"):
        load_data(cfg)
    (tmp_path / "input.txt").write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(DatasetError, match="is not UTF-8 text"):
        load_data(cfg)


def test_the_shipped_sample_splits_into_training_and_validation_windows() -> None:
    spec = TASKS["charlm"]
    data = spec.load_data(str(CORPUS_SAMPLE.parent), CharLMOptions())
    assert data.validation is not None
    text = CORPUS_SAMPLE.read_text()
    assert len(data.train) == (int(len(text) * 0.9) - 1) // 64 and len(data.validation) > 0
    window = data.train[3]
    assert "".join(data.vocabulary[i] for i in window) == text[3 * 64 : 4 * 64 + 1]


def test_warmup_then_cosine_to_the_floor() -> None:
    factor = warmup_cosine(warmup=4, total=12, floor=0.1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(8) == pytest.approx(0.55)  # half way down the cosine
    assert factor(12) == pytest.approx(0.1) and factor(100) == pytest.approx(0.1)


def test_evaluations_log_the_validation_loss_and_a_line_and_change_nothing(
    tmp_path: Path,
) -> None:
    data = make_data("charlm", tmp_path / "data")
    evaluated, code = run_here(
        tmp_path / "eval", data, flags("charlm", "--max-steps=4", "--eval-every=2")
    )
    assert code == OK
    records = read_lines(evaluated.stream.getvalue())
    evals = events_named(records, EVALUATED)
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["eval_loss"] > 0 and isinstance(r["sample"], str) for r in evals)
    (finished,) = events_named(records, FINISHED)
    assert finished["eval_loss"] == evals[-1]["eval_loss"]
    _, code = run_here(tmp_path / "plain", data, flags("charlm", "--max-steps=4"))
    assert code == OK
    same = max_abs_difference(
        *(final_parameters(tmp_path / r / "durable") for r in ("eval", "plain"))
    )
    assert same == 0.0


def test_on_the_cpu_the_loss_stays_in_the_runs_dtype(tmp_path: Path) -> None:
    data = make_data("charlm", tmp_path / "data")
    h, code = run_here(tmp_path, data, flags("charlm", "--max-steps=1"))
    assert code == OK
    assert all(p.dtype == torch.float64 for p in h.trainer.model.parameters())
