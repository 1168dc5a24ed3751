"""The step guard, the NCCL settings, and a fork server that never touches CUDA.

The end-to-end proof on CPU (NCCL's stream-ordered completion emulated on gloo, a peer killed, 0
steps lost and the trajectory kept) is in ``tests/training/test_elastic_training.py``. The NCCL test
below runs only where two GPUs are at hand.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.emulated_stream import REFERENCE, EmulatedStream
from tests.support.trainer_harness import harness, sigterm_during
from tests.support.waiting import gloo_group, holds_within
from training.checkpoints.checkpoint import deserialize
from training.elastic.exit_codes import WORKER_RESTART
from training.elastic.faults import PeerLostError
from training.loop import step_guard, trainer
from training.loop.metrics import Phases
from training.loop.step_guard import (
    STREAM_ENV,
    StepGate,
    StepGuard,
    _to_cpu,
    cpu_state,
    mark_state_written,
    needs_guard,
    state_reads,
)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gloo_needs_no_guard_nccl_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STREAM_ENV, raising=False)
    assert not needs_guard("gloo") and needs_guard("nccl")
    monkeypatch.setenv(STREAM_ENV, REFERENCE)
    assert needs_guard("gloo")


def test_a_stream_that_does_not_import_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STREAM_ENV, "tests.support.nowhere:Stream")
    with pytest.raises(ValueError, match="TRAIN_GRADIENT_STREAM='tests.support.nowhere:Stream'"):
        StepGuard.create("gloo", timeout_s=10)


def test_the_guard_passes_when_every_rank_finished(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STREAM_ENV, REFERENCE)
    guard = StepGuard.create("gloo", timeout_s=10)
    assert guard.active
    guard.vote(guard.settle())
    monkeypatch.delenv(STREAM_ENV)
    assert not StepGuard.create("gloo", timeout_s=10).active


def test_the_vote_runs_on_every_backend_and_a_no_stops_every_rank(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(STREAM_ENV, raising=False)
    guard = StepGuard.create("gloo", timeout_s=10)
    assert not guard.active  # no group of its own on gloo: the default one carries the vote
    guard.vote(True)
    with pytest.raises(PeerLostError, match="0 of 1 ranks apply the step"):
        guard.vote(False)


def test_the_gate_puts_a_stop_on_one_side_of_the_step() -> None:
    gate = StepGate()
    assert gate.enter()  # the main thread votes yes on step k
    assert not gate.claim(0)  # a stop now waits for step k (here: gives up at once)
    gate.leave()  # step k applied
    assert gate.claim(0)  # the stop reads step k
    assert not gate.enter()  # and the rank votes no on step k + 1


def test_a_stop_before_the_vote_makes_its_rank_vote_no() -> None:
    gate = StepGate()
    assert gate.claim(0)  # nothing in flight: the state is the last applied step's
    assert not gate.enter()
    gate.leave()  # the main thread leaves the gate either way
    assert gate.claim(0)


def test_the_cpu_copy_keeps_the_state_tree() -> None:
    state = {"w": torch.ones(2), "nested": [torch.zeros(1), (torch.full((1,), 2.0),)], "step": 3}
    copied = _to_cpu(state)
    assert copied["step"] == 3 and isinstance(copied["nested"][1], tuple)
    assert torch.equal(copied["w"], state["w"]) and torch.equal(
        copied["nested"][1][0], state["nested"][1][0]
    )


class _Fake:
    """Stand-ins for torch.cuda's Stream, Event and stream(): each call goes into ``log``."""

    def __init__(self, log: list[tuple[str, object]]) -> None:
        self.log = log
        fake = self

        class Event:
            def record(self, stream: object = None) -> None:
                fake.log.append(("record", self))

        class Stream:
            def wait_event(self, event: object) -> None:
                fake.log.append(("wait", (self, event)))

            def synchronize(self) -> None:
                fake.log.append(("synchronize", self))

        @contextmanager
        def stream(s: object) -> Iterator[None]:
            fake.log.append(("on", s))
            yield

        self.Event, self.Stream, self.stream = Event, Stream, stream


def test_the_copy_stream_waits_for_the_last_recorded_state_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[tuple[str, object]] = []
    fake = _Fake(log)
    monkeypatch.setattr(step_guard._WRITES, "event", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(step_guard, "_to_cpu", lambda obj: log.append(("copy", obj)) or obj)
    mark_state_written(torch.device("cuda"))  # step N-1
    mark_state_written(torch.device("cuda"))  # step N: the one the save must wait for
    cpu_state({"w": 1})
    kinds = [kind for kind, _ in log]
    assert kinds == ["record", "record", "wait", "on", "copy", "synchronize"], kinds
    (_, last_event), (_, (waiting, waited)), (_, copying_on) = log[1], log[2], log[3]
    assert waited is last_event and waiting is copying_on


def test_off_cuda_no_event_is_recorded_and_the_save_holds_the_last_step(
    tmp_path: Path, data_dir: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_event(*args: object, **kwargs: object) -> None:
        raise AssertionError("a CUDA event was created on the CPU")

    marked: list[torch.device] = []

    def mark(device: torch.device) -> None:
        marked.append(device)
        mark_state_written(device)

    monkeypatch.setattr(torch.cuda, "Event", no_event)
    monkeypatch.setattr(step_guard._WRITES, "event", None)
    monkeypatch.setattr(trainer, "mark_state_written", mark)
    h = harness(tmp_path, data_dir, "--checkpoint-every-steps=0")
    stop = SimpleNamespace(requested=False, at=None)
    sigterm_during(h, 3, stop)
    assert h.trainer.run(stop, Phases()) == WORKER_RESTART
    assert step_guard._WRITES.event is None
    assert marked and {d.type for d in marked} == {"cpu"}  # after every optimizer step
    loaded = h.local.load()
    assert loaded is not None
    saved = deserialize(loaded.data)
    assert saved["trainer"]["step"] == 3
    for name, value in h.trainer.model.state_dict().items():
        assert torch.equal(saved["model"]["model"][name], value), name


class _HostReads:
    """The trainer's step, logged in order: each ``backward``, the guard's waits (``settle``)
    and its ``vote``, and every read of a tensor's value into Python on the test's own thread
    (``read``). On a GPU a read blocks the host until all the stream has queued has run, a
    gradient all-reduce stuck on a dead peer included: only the guard's wait is bounded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, h: Any, settles: bool) -> None:
        self.log: list[str] = []
        me = threading.get_ident()
        for name in ("__float__", "item", "tolist"):
            real = getattr(torch.Tensor, name)

            def read(tensor: torch.Tensor, *args: Any, _real: Any = real) -> Any:
                if threading.get_ident() == me:
                    self.log.append("read")
                return _real(tensor, *args)

            monkeypatch.setattr(torch.Tensor, name, read)
        precision, guard = h.trainer.precision, h.trainer.guard
        backward, synchronize, vote = precision.backward, guard.stream.synchronize, guard.vote

        def logged_backward(loss: torch.Tensor) -> None:
            backward(loss)
            self.log.append("backward")

        def logged_synchronize(timeout_s: float) -> bool:
            self.log.append("settle")
            return synchronize(timeout_s) and settles

        def logged_vote(applies: bool) -> None:
            self.log.append("vote")
            vote(applies)

        monkeypatch.setattr(precision, "backward", logged_backward)
        monkeypatch.setattr(guard.stream, "synchronize", logged_synchronize)
        monkeypatch.setattr(guard, "vote", logged_vote)

    def after_the_last_backward(self) -> list[str]:
        last = len(self.log) - 1 - self.log[::-1].index("backward")
        return self.log[last + 1 :]


@pytest.mark.parametrize("settles", [True, False], ids=["finished", "stuck"])
def test_nothing_reads_the_device_between_backward_and_the_guards_bounded_wait(
    tmp_path: Path,
    data_dir: Path,
    world_of_one: None,
    monkeypatch: pytest.MonkeyPatch,
    settles: bool,
) -> None:
    # ``float(loss)`` right after backward() waited for the gradient all-reduce on the host:
    # a peer dead inside it held the step there until NCCL's watchdog, never reaching the
    # guard's bounded wait. The loss is read only once the step is voted through.
    monkeypatch.setenv(STREAM_ENV, REFERENCE)
    h = harness(tmp_path, data_dir, "--checkpoint-every-steps=0", "--micro-batch-size=4")
    h.trainer.guard = StepGuard.create("gloo", timeout_s=10)
    h.trainer.restore()
    h.trainer._wrap(Phases())
    reads = _HostReads(monkeypatch, h, settles)
    if settles:
        loss_sum, _ = h.trainer.train_step()
        assert loss_sum > 0 and h.trainer.state.step == 1
    else:
        with pytest.raises(PeerLostError, match="0 of 1 ranks apply the step"):
            h.trainer.train_step()
        assert h.trainer.state.step == 0
    assert reads.log.count("backward") == 2  # both micro-batches
    after = reads.after_the_last_backward()
    assert after[0] == "settle", reads.log
    if not settles:  # nothing read from the device at all before the vote refuses the step
        assert "read" not in after[: after.index("vote")], reads.log


def test_a_finished_all_reduce_on_an_aborted_communicator_is_not_a_finished_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After the watchdog aborts a communicator its kernels return, and the event polled says
    # done with the gradients half reduced: the error NCCL recorded is what tells.
    class Done:
        def record(self, stream: object = None) -> None:
            pass

        def query(self) -> bool:
            return True

    monkeypatch.setattr(torch.cuda, "Event", Done)
    errors: list[str | None] = [None, "COMM_ERROR"]
    stream = step_guard.CudaStream(lambda: errors[0])
    assert stream.synchronize(timeout_s=1)
    errors.pop(0)
    assert not stream.synchronize(timeout_s=1)


def test_the_communicators_error_is_read_from_its_nccl_backend() -> None:
    class Backend:
        def __init__(self, error: str) -> None:
            self.error = SimpleNamespace(name=error)

        def get_error(self) -> object:
            return self.error

    def group(error: str) -> Any:
        backends = {torch.device("cuda"): Backend(error)}
        return SimpleNamespace(_get_backend=lambda device: backends[device])

    assert step_guard.communicator_error(group("SUCCESS")) is None
    assert step_guard.communicator_error(group("TIMEOUT")) == "TIMEOUT"

    def no_nccl(device: torch.device) -> object:
        raise RuntimeError("No backend type associated with device type cuda")

    assert step_guard.communicator_error(SimpleNamespace(_get_backend=no_nccl)) is None


def _copied_in_state_reads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """As a sharded part is written: tensor by tensor, inside ``state_reads``."""
    with state_reads():
        return [t.cpu() for t in tensors]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: only there can a copy overtake"
)
@pytest.mark.parametrize("copy_state", [cpu_state, _copied_in_state_reads])
def test_on_a_gpu_a_sigterm_right_after_a_slow_step_saves_that_step_whole(
    copy_state: Any,
) -> None:
    device = torch.device("cuda")
    params = [torch.nn.Parameter(torch.zeros(1 << 16, device=device)) for _ in range(4)]

    class Slow(torch.optim.Optimizer):
        """Each parameter's update queued behind a kernel that spins for a while."""

        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {})

        @torch.no_grad()
        def step(self, closure: object = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    torch.cuda._sleep(100_000_000)  # tens of ms on any current GPU
                    p.add_(1.0)

    optimizer, lock = Slow(params), threading.Lock()
    for step in range(1, 4):
        with lock:  # the trainer's state lock: the step, then its event
            optimizer.step()
            mark_state_written(device)
        saved: list[list[torch.Tensor]] = []

        def sigterm(into: list[list[torch.Tensor]]) -> None:  # the stop thread: lock, copy
            with lock:
                into.append(copy_state([p.detach() for p in params]))

        thread = threading.Thread(target=sigterm, args=(saved,))
        thread.start()
        thread.join(120)
        (copy,) = saved
        assert [float(t.min()) for t in copy] == [float(step)] * 4
        assert [float(t.max()) for t in copy] == [float(step)] * 4


def _window_rank(rank: int, root: str, results: dict) -> None:
    os.environ[STREAM_ENV] = REFERENCE
    with gloo_group(f"{root}/init", rank, 2):
        guard = StepGuard.create("gloo", timeout_s=30)
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        ddp.register_comm_hook(guard.stream, EmulatedStream.comm_hook)
        passed = Path(root) / "rank-1-passed-the-guard"
        if rank == 0:
            # Rank 0's stream is busy with earlier work until rank 1 passed its guard (or a
            # while: the guard must not let rank 1 pass before this rank's all-reduce ran).
            guard.stream.enqueue(lambda: holds_within(passed.exists, 3.0))
        ddp(torch.full((1, 64), float(rank + 1))).sum().backward()
        results[f"backward-{rank}"] = float(model.weight.grad[0, 0])
        guard.vote(guard.settle())
        results[f"guard-{rank}"] = float(model.weight.grad[0, 0])
        if rank == 1:
            passed.touch()


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_no_rank_passes_the_guard_before_every_all_reduce_finished(tmp_path: Path) -> None:
    # d(sum(Wx + b))/dW is x: 1 on rank 0, 2 on rank 1; the reduced gradient is their mean.
    results = mp.Manager().dict()
    mp.spawn(_window_rank, args=(str(tmp_path), results), nprocs=2, join=True)
    # The emulation has NCCL's ordering: backward() returned with the all-reduce only queued.
    assert results["backward-1"] == 1.0
    # The guard proved it finished everywhere: both apply the fully reduced gradient.
    assert (results["guard-0"], results["guard-1"]) == (1.5, 1.5)


def test_the_window_loss_goes_over_the_guards_gloo_group(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STREAM_ENV, REFERENCE)
    guard = StepGuard.create("gloo", timeout_s=10)
    groups: list[object] = []
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        groups.append(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert guard.all_reduce(torch.tensor([2.0, 4.0])).tolist() == [2.0, 4.0]
    assert groups == [guard.group] and guard.group is not None


# ---- NCCL, for the day two GPUs are at hand -----------------------------------------------------


def _nccl_rank(rank: int, port: int, results: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCH_NCCL_ASYNC_ERROR_HANDLING="2",
        TORCH_NCCL_BLOCKING_WAIT="0",
    )
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    guard = StepGuard.create("nccl", timeout_s=5)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(256, 256).cuda(), device_ids=[rank]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 6):
        if rank == 1 and step == 4:
            os._exit(0)  # the peer vanishes mid-run
        optimizer.zero_grad()
        model(torch.randn(32, 256, device="cuda")).sum().backward()
        started = time.monotonic()
        try:
            guard.vote(guard.settle())
        except Exception:
            results["caught_after_s"] = time.monotonic() - started
            results["step"] = step - 1
            break
        optimizer.step()
    from training.loop.step_guard import abort_collectives

    abort_collectives()
    started = time.monotonic()
    state = cpu_state(model.module.state_dict())
    results["saved_after_s"] = time.monotonic() - started
    results["on_cpu"] = all(not t.is_cuda for t in state.values())
    os._exit(0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_on_nccl_a_vanished_peer_raises_before_the_step_and_the_save_does_not_hang() -> None:
    from tests.support.loopback import free_port

    results = mp.Manager().dict()
    mp.spawn(_nccl_rank, args=(free_port(), results), nprocs=2, join=True)
    assert results["step"] == 3
    assert results["caught_after_s"] < 5 + 2
    assert results["saved_after_s"] < 10 and results["on_cpu"]


def test_a_stop_during_the_vote_takes_a_replicated_state_at_once() -> None:
    # A peer frozen inside the vote's all-reduce held a DDP rank in it until the collective
    # timeout (30 s), and its stop's save waited for the vote: the survivors re-formed only
    # then. A replicated state needs no wait: this rank will not apply the step, and a resume
    # takes the newest replica.
    gate = StepGate(wait_for_vote=False)
    assert gate.enter()
    assert gate.claim(timeout_s=0)  # at once, the vote still in flight
    assert not gate.applying()  # the vote came back: the step is not applied
    gate.leave()


def test_a_stop_during_the_vote_waits_for_a_sharded_state() -> None:
    # FSDP2: the peers may apply the step, and every shard must hold the same one.
    gate = StepGate(wait_for_vote=True)
    assert gate.enter()
    assert not gate.claim(timeout_s=0)  # still in flight
    assert gate.applying()
    gate.leave()
    assert gate.claim(timeout_s=0)


def test_a_stop_once_the_step_is_applying_waits_for_it_either_way() -> None:
    for wait_for_vote in (False, True):
        gate = StepGate(wait_for_vote=wait_for_vote)
        assert gate.enter() and gate.applying()
        assert not gate.claim(timeout_s=0)
        gate.leave()
        assert gate.claim(timeout_s=0)
        assert not gate.enter()  # claimed: the next step is voted no
