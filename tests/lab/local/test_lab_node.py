"""A lab node with a stand-in agent: a real process tree, real signals, real log files."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from lab.local import process_tree
from lab.local.node import NodeLaunch, TorchrunNode, node_env, stop_nodes, wait_for_exit
from lab.report.node_logs import read_jsonl
from training.elastic.launch import ElasticPolicy, train_command
from training.records import EMERGENCY_SAVE, STARTED

# Like torchrun: one worker in its own session; SIGTERM is forwarded and the agent exits.
AGENT = """
import json, os, signal, subprocess, sys, tempfile, time
worker = subprocess.Popen(
    [sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"], start_new_session=True
)
def stop(signum, frame):
    worker.terminate(); worker.wait()
    print(json.dumps({"kind": "event", "event": "emergency_save", "ts": time.time()}), flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
print(json.dumps({"kind": "event", "event": "started", "ts": time.time(),
                  "endpoint": os.environ["PET_RDZV_ENDPOINT"], "worker": worker.pid,
                  "cwd": os.getcwd(), "tmp": tempfile.gettempdir()}), flush=True)
print("agent log line", file=sys.stderr, flush=True)
while True:
    time.sleep(0.05)
"""


def _policy() -> ElasticPolicy:
    return ElasticPolicy(
        rdzv_host="127.0.0.1",
        rdzv_port=23791,
        rdzv_id="lab-test",
        min_nodes=1,
        max_nodes=3,
        max_restarts=10,
    )


# An agent stuck in its exit barrier: it notes the SIGTERM and goes on.
STUCK_AGENT = AGENT.replace(
    "signal.signal(signal.SIGTERM, stop)",
    "signal.signal(signal.SIGTERM, lambda signum, frame: print(json.dumps("
    "{'kind': 'event', 'event': 'sigterm', 'ts': time.time()}), flush=True))",
)


def _node(tmp_path: Path, name: str = "node-0", agent: str = AGENT) -> TorchrunNode:
    tmp_dir = tmp_path / "tmp" / name
    env = node_env(_policy(), "/durable", tmp_path / "local", 7, tmp_dir=tmp_dir)
    launch = NodeLaunch(
        name,
        [sys.executable, "-c", agent],
        env,
        tmp_path,
        tmp_path / "logs",
        tmp_path / "local",
        tmp_dir,
    )
    return TorchrunNode(launch)


@pytest.fixture
def node(tmp_path: Path, processes: None):
    node = _node(tmp_path)
    yield node
    node.terminate(grace_s=1.0)


def _started(node: TorchrunNode, count: int = 1) -> list[dict]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        lines = node.stdout_path.read_text().splitlines() if node.stdout_path.exists() else []
        records = [json.loads(line) for line in lines]
        if sum(r["event"] == STARTED for r in records) >= count:
            return records
        time.sleep(0.05)
    raise AssertionError(f"{node.name} did not start")


def test_env_is_the_pods_env(tmp_path: Path) -> None:
    env = node_env(_policy(), "/durable", tmp_path / "n0", 7, tmp_dir=tmp_path / "t0")
    assert env["PET_RDZV_BACKEND"] == "etcd"
    assert env["PET_RDZV_ENDPOINT"] == "127.0.0.1:23791"
    assert env["PET_NNODES"] == "1:3"
    assert env["PET_RDZV_CONF"].startswith("last_call_timeout=1,")
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TRAIN_CHECKPOINT_URI"] == "/durable"
    assert env["TRAIN_LOCAL_DIR"] == str(tmp_path / "n0")
    assert env["TRAIN_COLLECTIVE_TIMEOUT_S"] == "7"
    # Lab only: torchelastic_* dirs land in the workspace; agents log their rounds.
    assert env["TMPDIR"] == str(tmp_path / "t0")
    assert env["LOGLEVEL"] == "INFO"


def test_a_node_runs_the_pods_command_with_the_labs_interpreter() -> None:
    command = train_command(["--max-steps=5"], sys.executable)
    assert command == [
        sys.executable,
        "-m",
        "training.agent",
        "--module",
        "training.train",
        "--max-steps=5",
    ]


def test_start_writes_own_logs_with_env_and_cwd(node: TorchrunNode, tmp_path: Path) -> None:
    node.start()
    started = _started(node)[0]
    assert started["endpoint"] == "127.0.0.1:23791"
    assert started["cwd"] == str(tmp_path)
    assert node.stdout_path == tmp_path / "logs" / "node-0.jsonl"
    assert (tmp_path / "local").is_dir()
    # The node's TMPDIR exists, so tempfile does not fall back to the system's /tmp.
    assert started["tmp"] == str(tmp_path / "tmp" / "node-0")
    assert node.poll() is None
    assert wait_for_exit(node, 0.5) is None
    assert "agent log line" in node.stderr_path.read_text()


def test_kill_takes_the_whole_tree(node: TorchrunNode) -> None:
    node.start()
    worker = _started(node)[0]["worker"]
    node.kill()
    assert node.poll() == -9
    deadline = time.monotonic() + 5
    while process_tree.is_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not process_tree.is_alive(worker)
    node.kill()  # twice: harmless


def test_eviction_notice_lets_the_agent_drain(node: TorchrunNode) -> None:
    node.start()
    _started(node)
    node.notify_eviction()
    assert wait_for_exit(node, 10) == 75
    assert json.loads(node.stdout_path.read_text().splitlines()[-1])["event"] == EMERGENCY_SAVE


def test_freeze_then_terminate(node: TorchrunNode) -> None:
    node.start()
    worker = _started(node)[0]["worker"]
    node.freeze()
    deadline = time.monotonic() + 5  # SIGSTOP is delivered asynchronously
    while not (process_tree.is_stopped(node.pid) and process_tree.is_stopped(worker)):
        assert time.monotonic() < deadline, "the tree did not stop"
        time.sleep(0.02)
    node.terminate(grace_s=5)  # a frozen tree gets SIGKILL, not a SIGTERM it cannot act on
    assert node.poll() == -9
    node.terminate(grace_s=5)


def test_restart_in_place_appends_to_the_same_log(node: TorchrunNode) -> None:
    node.start()
    _started(node)
    node.kill()
    node.start()
    records = _started(node, count=2)
    assert node.starts == 2
    assert [r["event"] for r in records] == ["started", "started"]


@pytest.mark.usefixtures("processes")
def test_stop_nodes_gives_every_stuck_node_one_shared_grace_period(tmp_path: Path) -> None:
    nodes = [_node(tmp_path, f"node-{n}", STUCK_AGENT) for n in range(3)]
    try:
        for node in nodes:
            node.start()
        workers = [_started(node)[0]["worker"] for node in nodes]
        stop_nodes(nodes, grace_s=3.0)
    finally:
        stop_nodes(nodes, grace_s=0.0)
    noted = [[r["ts"] for r in read_jsonl(n.stdout_path) if r["event"] == "sigterm"] for n in nodes]
    assert all(len(times) == 1 for times in noted), noted
    # One after another, each node would get its SIGTERM only after the previous one's 3 s
    # grace ran out; together, all three get it before any grace ends.
    firsts = [times[0] for times in noted]
    assert max(firsts) - min(firsts) < 3.0
    assert all(node.poll() == -9 for node in nodes)
    assert not any(process_tree.is_alive(w) for w in workers)
    stop_nodes(nodes, grace_s=1.5)  # twice: harmless and immediate
