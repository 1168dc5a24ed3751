"""Node-local emergency saves are pruned to ``keep``, never deleting the newest nor one that a
reader or the agent's durable commit is still using."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from training.checkpoints.checkpoint import deserialize
from training.checkpoints.node_local import NodeLocalState
from training.checkpoints.node_prune import scratch_folder, sweep_scratch
from training.checkpoints.serialization import load_mapped
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.sharded.writer import SaveOptions
from training.checkpoints.storage import FileStore

RUN = "run-1"


def _state(step: int) -> dict[str, torch.Tensor | int]:
    return {"step": step, "w": torch.full((8,), float(step))}


def _saves(root: Path) -> tuple[list[str], list[str]]:
    """(checkpoint files, manifests) of the node-local directory."""
    names = sorted(p.name for p in (root / RUN).iterdir() if not p.name.startswith("."))
    return (
        [n for n in names if n.endswith(".pt")],
        [n for n in names if n.startswith("emergency-manifest-")],
    )


@pytest.mark.parametrize("keep", [1, 2])
def test_ten_reforms_leave_at_most_keep_node_local_saves(tmp_path: Path, keep: int) -> None:
    for step in range(1, 11):  # each re-form opens the directory again and saves once
        local = NodeLocalState(tmp_path, RUN, keep=keep)
        local.save_state(step, _state(step))
        local.close()
        files, manifests = _saves(tmp_path)
        assert len(files) <= keep and len(manifests) <= keep, (step, files, manifests)
        loaded = NodeLocalState(tmp_path, RUN, keep=keep).load()
        assert loaded is not None and deserialize(loaded.data)["step"] == step


def _on_disk(root: Path) -> list[str]:
    """Every checkpoint file of the node-local directory, a save or one being deleted."""
    return sorted(p.name for p in (root / RUN).iterdir() if p.name.endswith(".pt"))


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("keep", [1, 2])
def test_ten_reforms_that_end_right_after_their_save_leave_at_most_keep(
    tmp_path: Path, keep: int
) -> None:
    # As the trainer makes them: each round is a process that opens the node's directory,
    # restores from it, saves once and ends with os._exit (``exit_now``), which no thread of
    # the process outlives.
    identity = {"global_batch_size": 8}
    for step in range(1, 11):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                local = NodeLocalState(tmp_path, RUN, expected_run=identity, keep=keep)
                held = local.restorable()
                local.wait_pruned()  # the round trains, far longer than its opening prune
                if step == 1 or (held is not None and held.entry.step == step - 1):
                    local.save_state(step, {**_state(step), "run": identity})
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"round {step} did not resume and save"
        files, manifests = _saves(tmp_path)
        assert len(files) <= keep and len(manifests) <= keep, (step, files, manifests)
        # A save retired just before the exit may wait on disk for the next round to delete it.
        assert len(_on_disk(tmp_path)) <= keep + 1, (step, _on_disk(tmp_path))
    next_round = NodeLocalState(tmp_path, RUN, expected_run=identity, keep=keep)
    next_round.wait_pruned()
    assert len(_on_disk(tmp_path)) <= keep, _on_disk(tmp_path)
    held = next_round.restorable()
    assert held is not None and held.entry.step == 10


def test_saves_through_bytes_are_pruned_too(tmp_path: Path) -> None:
    from training.checkpoints.checkpoint import serialize

    local = NodeLocalState(tmp_path, RUN)
    for step in range(1, 6):
        local.save(step, serialize(_state(step)))
    local.wait_pruned()
    files, manifests = _saves(tmp_path)
    assert (len(files), len(manifests)) == (1, 1)


def test_saves_while_an_earlier_prune_runs_are_pruned_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loaded machine: the first save's prune holds the directory, having listed only what
    # was there then, while four more saves land; each of their prunes finds the lock taken.
    from training.checkpoints import node_prune
    from training.checkpoints.checkpoint import serialize

    listed, go_on = threading.Event(), threading.Event()
    real_doomed = node_prune._doomed

    def slow_first(root: Path, prefix: str, keep: int) -> list[str]:
        doomed = real_doomed(root, prefix, keep)
        if not listed.is_set():
            listed.set()
            go_on.wait()
        return doomed

    monkeypatch.setattr(node_prune, "_doomed", slow_first)
    local = NodeLocalState(tmp_path, RUN)
    local.save(1, serialize(_state(1)))
    assert listed.wait(30), "the first prune never listed the directory"
    for step in range(2, 6):
        local.save(step, serialize(_state(step)))
    go_on.set()
    local.wait_pruned()
    files, manifests = _saves(tmp_path)
    assert (len(files), len(manifests)) == (1, 1), (files, manifests)


def test_the_save_the_agent_is_committing_is_never_pruned(tmp_path: Path) -> None:
    NodeLocalState(tmp_path, RUN).save_state(5, _state(5))
    # The agent, after its SIGTERM, picked the node's newest save and streams its file...
    agent = NodeLocalState(tmp_path, RUN)
    newest = agent.newest()
    assert newest is not None and newest[0] == 5
    _, payload = newest
    # ...while a worker of another round on this node saves twice and prunes.
    worker = NodeLocalState(tmp_path, RUN)
    worker.save_state(6, _state(6))
    worker.save_state(7, _state(7))
    worker.wait_pruned()
    assert isinstance(payload.source, Path) and payload.source.exists()
    durable = ShardedCheckpoints(FileStore(tmp_path / "durable"), tmp_path / "scratch")
    options = SaveOptions(prune=False, newer_only=True)
    durable.save_alone(load_mapped(payload.source), 5, options)  # as the agent commits it
    read = durable.read_whole("w")
    assert read is not None and read[0].step == 5 and read[1]["w"].tolist() == [5.0] * 8
    # Once the agent is done (its process exits; here: close), the next save prunes it.
    agent.close()
    worker.save_state(8, _state(8))
    worker.wait_pruned()
    assert not payload.source.exists()
    files, _ = _saves(tmp_path)
    assert len(files) == 1


def test_a_prune_never_removes_the_save_a_reader_is_reading(tmp_path: Path) -> None:
    NodeLocalState(tmp_path, RUN).save_state(5, _state(5))
    resolved, pruned = threading.Event(), threading.Event()

    class Paused(FileStore):
        """A reader that read the manifests and waits before it opens the checkpoint."""

        def get(self, name: str) -> bytes:
            if name.endswith(".pt"):
                resolved.set()
                assert pruned.wait(30), "the writer never finished"
            return super().get(name)

    reader = NodeLocalState(tmp_path, RUN)
    reader.repository.store = Paused(tmp_path / RUN, fsync=False)
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(reader.load()))
    thread.start()
    try:
        assert resolved.wait(30)
        writer = NodeLocalState(tmp_path, RUN)
        writer.save_state(6, _state(6))  # prunes, or would, step 5
        writer.save_state(7, _state(7))
        writer.wait_pruned()
    finally:
        pruned.set()
        thread.join(30)
    loaded = found[0]
    assert loaded is not None and loaded.entry.step == 5  # type: ignore[attr-defined]
    # With the reader gone, the next save prunes down to keep.
    writer.save_state(8, _state(8))
    writer.wait_pruned()
    files, manifests = _saves(tmp_path)
    assert (len(files), len(manifests)) == (1, 1)


def test_the_newest_is_kept_when_every_older_save_is_gone(tmp_path: Path) -> None:
    local = NodeLocalState(tmp_path, RUN)
    local.save_state(3, _state(3))
    for leftover in (tmp_path / RUN).glob("emergency-manifest-*"):
        leftover.unlink()  # nothing valid names a save: nothing is pruned by guesswork
    local.save_state(4, _state(4))
    local.wait_pruned()
    files, _ = _saves(tmp_path)
    assert len(files) == 1
    loaded = NodeLocalState(tmp_path, RUN).load()
    assert loaded is not None and loaded.entry.step == 4


@pytest.mark.usefixtures("processes")
def test_a_forked_child_keeps_none_of_the_parents_locks(tmp_path: Path) -> None:
    local = NodeLocalState(tmp_path, RUN)
    local.save_state(5, _state(5))  # pinned by this process
    local.wait_pruned()
    (first,), _ = _saves(tmp_path)
    up_r, up_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()  # a DataLoader worker, say, forked while the pin is held
    if pid == 0:
        # Python code runs in the child only after its at-fork hooks: it is ready then.
        os.write(up_w, b"u")
        os.read(go_r, 1)
        os._exit(0)
    os.close(up_w)
    os.close(go_r)
    try:
        assert os.read(up_r, 1) == b"u"  # the child lives, holding whatever it inherited
        local.save_state(6, _state(6))  # this process lets step 5 go; the child must too
        local.wait_pruned()
        assert not (tmp_path / RUN / first).exists()
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
        os.close(up_r)
        os.waitpid(pid, 0)


def _write_then_hang(root: Path, ready: multiprocessing.synchronize.Event) -> None:
    with scratch_folder(root, ".spool-") as folder:
        (folder / "state.pt").write_bytes(b"x" * 4096)  # a save cut off half-way
        ready.set()
        time.sleep(600)


@pytest.mark.usefixtures("processes")
def test_a_scratch_folder_a_killed_process_left_is_swept_and_one_in_use_is_not(
    tmp_path: Path,
) -> None:
    """A save or a load killed mid-way leaves its files in ``<local-dir>/.scratch``: up to a
    whole state each time, until the disk is full. The next process's sweep removes every
    folder no live process holds, and never one that a live process (another local rank)
    still writes."""
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    killed = fork.Process(target=_write_then_hang, args=(tmp_path, ready))
    killed.start()
    assert ready.wait(60)
    os.kill(killed.pid, signal.SIGKILL)  # type: ignore[arg-type]
    killed.join()
    (left,) = [p.name for p in tmp_path.iterdir()]
    with scratch_folder(tmp_path, ".load-") as mine:
        (mine / "file").write_bytes(b"y")
        assert sweep_scratch(tmp_path) == [left]
        assert [p.name for p in tmp_path.iterdir()] == [mine.name]
        assert (mine / "file").read_bytes() == b"y"
    assert list(tmp_path.iterdir()) == []  # the block's end removes its own folder
