"""The warm launcher: what its fork server preloads, how it reports a preload that failed, and
the torch behaviour it relies on, each failing at once when a torch upgrade changes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed.run
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException

from training.launcher import (
    PRELOAD,
    WORKER_IDENTICAL_ENV,
    AgentStop,
    LauncherError,
    torchrun_config,
)

REPO = Path(__file__).resolve().parents[2]

# A CUDA build as torch sees one, on this CPU-only torch: torch.cuda._is_compiled is
# ``hasattr(torch._C, "_cuda_getDeviceCount")``, and every way into the CUDA runtime is a call
# of a ``torch._C._cuda*`` function (cudaGetDeviceCount, which runs cuInit; ``_cuda_init``, which
# torch.cuda._lazy_init calls). Here each of them ends the process, naming itself; importing
# one is allowed, as a CUDA build's modules do. NVML sees one GPU (torch/cuda/__init__.py:
# ``device_count`` asks ``_device_count_nvml`` first).
AS_ON_A_GPU_NODE = """
import torch

def cuda_function(name):
    if not name.startswith(("_cuda", "_Cuda")):
        raise AttributeError(name)
    def initialised(*args, **kwargs):
        raise SystemExit(f"the CUDA runtime was initialised: torch._C.{name}")
    return initialised

torch._C.__getattr__ = cuda_function
torch.cuda._device_count_nvml = lambda: 1
"""


@pytest.mark.usefixtures("torchrun")
@pytest.mark.parametrize("nvml_check", ["1", "0"])
def test_what_the_fork_server_preloads_never_initialises_cuda(nvml_check: str) -> None:
    # A process that forks must not have initialised CUDA: its children could not use it. The
    # agent and the fork server ask "is there a GPU?" as the job's env says: through NVML.
    # Without that env (the control case) the same question initialises CUDA, and this test
    # sees it on a CPU build too.
    modules = ", ".join(PRELOAD) + ", training.launcher, training.agent, training.loop.step_guard"
    code = AS_ON_A_GPU_NODE + f"import {modules}\nprint(torch.cuda.is_available())\n"
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": nvml_check}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    if nvml_check == "1":
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "True"  # the GPU is seen, through NVML alone
    else:
        assert result.returncode != 0
        assert "the CUDA runtime was initialised: torch._C._cuda_getDeviceCount" in result.stderr


@pytest.mark.usefixtures("torchrun")
def test_a_preload_that_fails_to_import_stops_the_node_with_its_error(tmp_path: Path) -> None:
    # Python's fork server swallows an ImportError of a preload and then forks cold workers,
    # each failing or importing on its own: the readiness check must say which and why.
    (tmp_path / "broken_preload.py").write_text("import a_module_that_is_not_installed\n")
    code = (
        "from training import launcher\n"
        "launcher.PRELOAD = (*launcher.PRELOAD[:1], 'broken_preload')\n"
        "launcher.start_fork_server()\n"
        "launcher.wait_until_warm()\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "LauncherError: the fork server could not import broken_preload" in result.stderr
    assert "No module named 'a_module_that_is_not_installed'" in result.stderr
    assert "TRAIN_LAUNCHER=torchrun" in result.stderr


def test_torchruns_flags_are_parsed_by_torchrun() -> None:
    parsed, config = torchrun_config(["--nnodes=1:3", "--module", "training.train", "--x", "1"])
    assert (parsed.module, parsed.training_script, parsed.training_script_args) == (
        True,
        "training.train",
        ["--x", "1"],
    )
    assert (config.min_nodes, config.max_nodes) == (1, 3)


@pytest.mark.parametrize("change", ["parse_args gone", "config_from_args returns a dict"])
def test_a_torch_that_changed_torchruns_parsing_stops_the_node_naming_the_fallback(
    monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    if change == "parse_args gone":
        monkeypatch.delattr(torch.distributed.run, "parse_args")
    else:
        monkeypatch.setattr(torch.distributed.run, "config_from_args", lambda args: {})
    with pytest.raises(LauncherError, match="set TRAIN_LAUNCHER=torchrun"):
        torchrun_config(["--nnodes=1", "--module", "training.train"])


def test_torchs_agent_gives_identical_workers_their_ranks_without_its_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The launcher sets TORCH_ELASTIC_WORKER_IDENTICAL so that no agent waits in the round's
    # store for a member that died right after the round completed. This fails if a torch
    # upgrade drops that documented fast path (SimpleElasticAgent._assign_worker_ranks).
    class Untouchable:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the agent used its store ({name})")

    monkeypatch.setenv(WORKER_IDENTICAL_ENV, "1")
    spec = WorkerSpec(
        role="trainer", local_world_size=2, rdzv_handler=Untouchable(), entrypoint=print
    )
    workers = SimpleElasticAgent._assign_worker_ranks(None, Untouchable(), 1, 3, spec)
    assert [(w.global_rank, w.world_size, w.role_rank) for w in workers] == [(2, 6, 2), (3, 6, 3)]


def test_a_sigterm_raised_inside_a_finalizer_is_lost_but_the_agent_keeps_its_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Why the stop is kept (chaos seed 147): the handler raises wherever the signal lands, and
    # Python only reports an exception raised in a finalizer, as torch's worker start runs
    # them. The rendezvous handler calls raise_if_stopped at its next poll
    # (test_agent_stop.py: the agent then forms no new group).
    # A real SIGTERM, sent to the main thread (where Python runs handlers), with SIGTERM
    # unblocked there for the test: another test in this process may have blocked it (a
    # worker's StopRequest does, for its sigwait thread), and a signal sent to the process
    # could go to such a thread. pthread_kill runs the handler before it returns.
    lost: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_value))
    stop = AgentStop()
    main_thread = threading.main_thread().ident
    assert main_thread is not None and threading.get_ident() == main_thread

    class Handles:
        def __del__(self) -> None:
            signal.pthread_kill(main_thread, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stop._handle)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        Handles()  # dropped at once: its finalizer runs here
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGTERM, previous)
    assert len(lost) == 1 and isinstance(lost[0], SignalException), lost
    assert stop.at is not None
    with pytest.raises(SignalException) as raised:
        stop.raise_if_stopped()
    assert raised.value.sigval == signal.SIGTERM


def test_an_agent_that_left_the_rendezvous_ends_for_a_new_pod(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch 2.13's SimpleElasticAgent.run (agent/server/api.py) logs a
    # RendezvousGracefulExitError and returns None; run_agent must not take that for a result.
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous import (
        RendezvousGracefulExitError,
        rendezvous_handler_registry,
    )

    from training import agent, launcher
    from training.elastic.exit_codes import RETRY_ME

    def left(self: LocalElasticAgent, role: str = "default") -> None:
        raise RendezvousGracefulExitError("node a has left run-1")

    monkeypatch.setattr(LocalElasticAgent, "_invoke_run", left)
    monkeypatch.setattr(rendezvous_handler_registry, "create_handler", lambda params: object())
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT")  # restored after
    _, config = torchrun_config(["--nnodes=1", "--module", "training.train"])
    monkeypatch.setattr(
        launcher, "launch", lambda args, handlers=None: launcher.run_agent(config, [])
    )
    monkeypatch.setattr(launcher, "STOP", AgentStop())
    assert agent._launch_warm([]) == (RETRY_ME, False)


# A worker whose loop returned while its SIGTERM thread still saves: the stop thread (a daemon,
# as torch's signal thread must not keep a process alive) holds the exit lock, saves, and ends
# the process with its own code. Forked the way torch's agent runs a warm worker: a
# multiprocessing Process, which ends the process once its target returns.
STOP_DURING_RETURN = """
import multiprocessing, sys, threading, time
from pathlib import Path

import training.train
from training.launcher import worker
from training.loop.trainer_state import _EXIT_LOCK, exit_now

saved = Path(sys.argv[1])

def run(argv):
    holding = threading.Event()

    def stop_thread():
        with _EXIT_LOCK:
            holding.set()
            time.sleep(0.5)  # a save in progress when the loop returns
            saved.write_text("the part of the last step")
            exit_now(75)

    threading.Thread(target=stop_thread, daemon=True).start()
    holding.wait()
    return 0

training.train.run = run
process = multiprocessing.get_context("fork").Process(target=worker)
process.start()
process.join()
print(process.exitcode)
"""


@pytest.mark.usefixtures("processes")
def test_a_worker_whose_loop_returned_waits_for_the_stop_threads_save(tmp_path: Path) -> None:
    saved = tmp_path / "part"
    result = subprocess.run(
        [sys.executable, "-c", STOP_DURING_RETURN, str(saved)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert saved.exists(), "the worker ended under the stop thread's save"
    assert result.stdout.split() == ["75"]  # the stop thread's code, not the loop's 0
