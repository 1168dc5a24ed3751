"""``lab export``: the newest verified checkpoint's model as one plain state dict, a .pt that
``torch.load(weights_only=True)`` reads and a .safetensors the format's own reader reads;
a torn checkpoint refused with one line. (DDP and fsdp2 runs on two nodes, exported and loaded
into a fresh model: tests/training/test_user_package_on_the_cluster.py.)"""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lab.azure import weights_export
from lab.azure.weights_export import checkpoints, verified
from lab.cli import main
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.state import ModelState
from training.checkpoints.storage import FileStore


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _save(store: FileStore, model: nn.Module, saved: nn.Module, step: int, tmp: Path) -> None:
    """``saved`` (``model`` or a wrapper of it) in a checkpoint of ``step``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # a state of the optimizer in the checkpoint too, as a run's
    ShardedCheckpoints(store, tmp / "scratch").save_alone(
        {"model": ModelState(saved, optimizer)}, step
    )


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A run's checkpoints at steps 10 and 20 (the second of a compiled model's wrapper)."""
    store = FileStore(tmp_path / "ckpt")
    saved = {}
    for step in (10, 20):
        torch.manual_seed(step)
        model = _net()
        _save(store, model, model if step == 10 else torch.compile(model), step, tmp_path)
        saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return tmp_path / "ckpt", saved


def test_the_newest_model_is_a_plain_state_dict_in_both_formats(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    uri, saved = run
    assert main(["export", "--checkpoint-uri", str(uri), "--out", str(tmp_path / "m.pt")]) == 0
    exported = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(exported) == list(saved[20])  # no _orig_mod., the model's own order
    assert all(torch.equal(exported[k], saved[20][k]) for k in saved[20])
    fresh = _net()
    fresh.load_state_dict(exported)  # strict: the same keys and shapes
    out = tmp_path / "m.safetensors"
    assert main(["export", "--checkpoint-uri", str(uri), "--out", str(out), "--step", "10"]) == 0
    older = load_file(out)
    assert sorted(older) == sorted(saved[10])
    assert all(torch.equal(older[k], saved[10][k]) for k in saved[10])


def test_a_torn_checkpoint_is_refused_or_passed_over_for_the_one_before(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    uri, saved = run
    (newest,) = uri.glob("dcp-0000000020-*.0-0.distcp")
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    out = tmp_path / "m.pt"
    assert main(["export", "--checkpoint-uri", str(uri), "--out", str(out), "--step", "20"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "checkpoint of step 20 refused:" in err and "is torn" in err
    assert not out.exists()
    assert main(["export", "--checkpoint-uri", str(uri), "--out", str(out)]) == 0
    assert "skipped the checkpoint of step 20" in capsys.readouterr().err
    exported = torch.load(out, weights_only=True)
    assert all(torch.equal(exported[k], saved[10][k]) for k in saved[10])


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--checkpoint-uri", "{tmp}/none", "--out", "{tmp}/m.pt"], "is not a directory"),
        (["--checkpoint-uri", "{tmp}", "--out", "{tmp}/m.pt"], "no checkpoint in"),
        (["--checkpoint-uri", "{tmp}", "--out", "{tmp}/m.bin"], "must end in .pt or .safetensors"),
    ],
)
def test_nothing_to_export_is_one_line_and_exit_2(
    flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", *(f.format(tmp=tmp_path) for f in flags)]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err


def test_a_scratch_directory_of_the_users_keeps_what_it_held(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    uri, _ = run
    scratch = tmp_path / "big-disk"
    scratch.mkdir()
    (scratch / "thesis.tex").write_text("mine")
    flags = ["--checkpoint-uri", str(uri), "--out", str(tmp_path / "m.pt")]
    assert main(["export", *flags, "--scratch", str(scratch)]) == 0
    assert [p.name for p in scratch.iterdir()] == ["thesis.tex"]


def test_the_check_of_a_directorys_checkpoint_holds_no_file_whole(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "ckpt")
    model = nn.Linear(2048, 4096)  # 32 MiB of weights: one file of that size
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": ModelState(model, optimizer)}
    ShardedCheckpoints(store, tmp_path / "scratch").save_alone(state, 1)
    (entry,) = checkpoints(store)
    assert max(f.size for f in entry.files) > 32 << 20
    tracemalloc.start()
    try:
        verified(store, entry, tmp_path / "unused")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # a few of the store's 4 MiB chunks, never the 32 MiB file


def test_a_checkpoint_torn_while_it_is_read_is_one_line_and_no_file(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A directory's checkpoint is checked, then read in place: a run still writing to it
    # prunes (or a disk tears) its files in between.
    uri, _ = run
    real = weights_export.tensor_reader

    def pruned_after_the_first_tensor(path: Path, metadata: Any) -> Any:
        read = real(path, metadata)

        def first_then_torn(name: str) -> torch.Tensor:
            tensor = read(name)
            for file in path.glob("dcp-0000000020-*.distcp"):
                file.write_bytes(b"")
            return tensor

        return first_then_torn

    monkeypatch.setattr(weights_export, "tensor_reader", pruned_after_the_first_tensor)
    out = tmp_path / "m.pt"
    assert main(["export", "--checkpoint-uri", str(uri), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "step 20" in err and "changed while it was read" in err
    assert not out.exists() and not list(tmp_path.glob(".m.pt*"))
