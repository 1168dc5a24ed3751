"""``python -m bench rendezvous-scale``: N rendezvous agents against one etcd 3.5, then a model.

Each agent is the handler the training runs (``training.rendezvous.create_handler``), without
workers. A 2-core machine cannot run 64 agent processes, so a few spawned worker processes
host the agents in threads, each with its own etcd clients and probe port. Per node count it
measures the first round, the re-form after one agent dies and after one leaves, false
deaths over a quiet window, and etcd's requests per second from etcd's own ``/metrics``.
Beyond the largest N it prints the model of bench/rendezvous_scale_model.py.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import queue
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any

from bench import rendezvous_scale_model as model
from bench.stats import summarize_known
from lab.local.etcd_server import EmbeddedEtcd, EtcdError, find_etcd_binary
from training.exit_codes import VERDICT_ENV
from training.launch import ROUND_FILE_ENV, RendezvousSettings
from training.liveness import PROBE_TIMEOUT_S

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
MONITOR_S = 0.1
"""torch's agent asks ``num_nodes_waiting`` this often (its monitor loop)."""
SETTLE_S = 1.0
"""After the first round, before the quiet window: the last watch re-reads finish."""
START_LEAD_S = 0.5
"""The first joins start together this long after the command, once every worker has it."""
COUNTERS = {
    "received": "etcd_http_received_total",
    "reads": "etcd_debugging_store_reads_total",
    "writes": "etcd_debugging_store_writes_total",
    "watches": "etcd_debugging_store_watch_requests_total",
    "expires": "etcd_debugging_store_expires_total",
    "etcd_cpu_s": "process_cpu_seconds_total",
}
"""etcd 3.5's counters: the v2 requests received, which leave watches out (its keys
handler counts a request only ``if !rr.Wait``), and the v2 store's reads, writes, watches
(one per watch request) and TTL expiries; plus etcd's own CPU time."""
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


class ScaleError(RuntimeError):
    """A worker process failed or did not answer."""


@dataclass(frozen=True)
class ScaleConfig:
    nodes: tuple[int, ...] = (8, 32, 64)
    reps: int = 3
    quiet_s: float = 10.0
    per_process: int = 16
    cap_s: int = 60
    """A round that has not formed this long after its start is an error (also the
    handlers' join_timeout, so a stuck next_rendezvous ends)."""
    model_nodes: tuple[int, ...] = (128, 256, 1024)

    def validate(self) -> None:
        """Raise ValueError naming the flag that is out of range."""
        if not self.nodes or min(self.nodes) < 3:
            raise ValueError("--nodes: every count must be >= 3 (one dies, one leaves)")
        if self.reps < 1:
            raise ValueError("--reps must be >= 1")
        if self.quiet_s <= 0:
            raise ValueError("--quiet-s must be > 0")
        if self.per_process < 1:
            raise ValueError("--per-process must be >= 1")
        if self.cap_s < 5:
            raise ValueError("--cap-s must be >= 5")


def rendezvous_conf(cap_s: int) -> dict[str, str]:
    """The shipped rendezvous settings, with join_timeout lowered to the cap."""
    return {**RendezvousSettings().conf(), "join_timeout": str(cap_s)}


# -- etcd's metrics --------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Each counter of COUNTERS summed over its labels, from Prometheus' text format."""
    families = {family: key for key, family in COUNTERS.items()}
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in families:
            totals[families[match.group(1)]] += float(match.group(3))
    return totals


def scrape(client_url: str) -> dict[str, float]:
    """etcd's counters now, with the monotonic time they were read at (``at``)."""
    with urllib.request.urlopen(f"{client_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {**parse_metrics(text), "at": time.monotonic()}


def etcd_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What etcd did between two scrapes: counts, requests/s (reads, writes and watches),
    and the CPU etcd used, in cores."""
    seconds = max(after["at"] - before["at"], 1e-6)
    diff = {key: after[key] - before[key] for key in COUNTERS}
    requests = diff["received"] + diff["watches"]
    return {
        "seconds": round(seconds, 3),
        **{key: round(value, 3) for key, value in diff.items()},
        "requests": requests,
        "req_s": round(requests / seconds, 1),
        "etcd_cpu_share": round(diff["etcd_cpu_s"] / seconds, 3),
    }


# -- the worker processes ----------------------------------------------------------------------
class _Host:
    """The agents of one worker process, and the commands the coordinator sends it."""

    def __init__(self, port: int, events: Any) -> None:
        self.port, self.events = port, events
        self.handlers: dict[int, Any] = {}
        self.gone: set[int] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def make(self, run_id: str, indices: list[int], max_nodes: int, conf: dict[str, str]) -> int:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from training.rendezvous import BACKEND, create_handler

        self.handlers, self.gone = {}, set()
        for index in indices:
            params = RendezvousParameters(
                BACKEND, f"127.0.0.1:{self.port}", run_id, 1, max_nodes, "127.0.0.1", **conf
            )
            self.handlers[index] = create_handler(params)  # the training's own path
        return len(indices)

    def _live(self) -> list[tuple[int, Any]]:
        return [(i, h) for i, h in self.handlers.items() if i not in self.gone]

    def join(self, phase: int, start: float) -> int:
        self._stop = threading.Event()
        for index, handler in self._live():
            args = (phase, index, handler, start, self._stop)
            thread = threading.Thread(target=self._drive, args=args, daemon=True)
            thread.start()
            self._threads.append(thread)
        return len(self._live())

    def _drive(self, phase: int, index: int, handler: Any, start: float, stop: Any) -> None:
        """One agent as torch's runs it: join, then poll num_nodes_waiting; >0: join again."""
        time.sleep(max(0.0, start - time.monotonic()))
        while not stop.is_set():
            try:
                info = handler.next_rendezvous()
            except Exception as exc:  # noqa: BLE001 - reported, the phase fails
                self.events.put((phase, index, "error", repr(exc), time.monotonic()))
                return
            joined = (handler.round, info.rank, info.world_size)
            self.events.put((phase, index, "joined", joined, time.monotonic()))
            while not stop.wait(MONITOR_S):
                if handler.num_nodes_waiting() > 0:
                    break

    def stop(self) -> int:
        """End the agents' loops; how many are still inside next_rendezvous."""
        self._stop.set()
        deadline = time.monotonic() + 2.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        return len(self._threads)

    def quiet(self, until: float, every_s: float) -> dict[int, int]:
        """Poll every live agent's num_nodes_waiting until ``until``; >0 polls per agent."""
        positives = {index: 0 for index, _ in self._live()}
        while (now := time.monotonic()) < until:
            for index, handler in self._live():
                positives[index] += handler.num_nodes_waiting() > 0
            time.sleep(max(0.0, now + every_s - time.monotonic()))
        return positives

    def kill(self, index: int) -> float:
        """What SIGKILL leaves: no more heartbeats, a refused port, a key until its TTL.
        (The handler's private fields, as in tests/test_rendezvous.py: it has no public
        way to die without leaving.)"""
        at = time.monotonic()
        handler = self.handlers[index]
        handler._stop.set()
        handler._probe.close()
        self.gone.add(index)
        return at

    def leave(self, index: int) -> float:
        at = time.monotonic()
        self.handlers[index].leave()
        self.gone.add(index)
        return at

    def close(self) -> int:
        self.stop()
        for _, handler in self._live():
            handler.leave()
        return len(self._live())


def _worker_main(conn: Connection, events: Any, port: int, log_path: str) -> None:
    """A spawned worker: hosts agents, answers ``(command, args)`` with ``(ok|error, value)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops us
    for var in (VERDICT_ENV, ROUND_FILE_ENV):
        os.environ.pop(var, None)
    logging.basicConfig(
        filename=log_path, level=logging.INFO, format=f"%(asctime)s {os.getpid()} %(message)s"
    )
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    import training.rendezvous  # noqa: F401 - torch, once, before "ready"

    host = _Host(port, events)
    conn.send(("ok", os.getpid()))
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):
            return  # the coordinator is gone
        if command == "exit":
            return
        try:
            conn.send(("ok", getattr(host, command)(*args)))
        except Exception as exc:  # noqa: BLE001 - the coordinator decides
            conn.send(("error", f"{command}: {exc!r}"))


class Fleet:
    """The worker processes for N agents: agent ``i`` lives in process ``i // per_process``."""

    def __init__(self, nodes: int, per_process: int, port: int, log_path: Path) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        self.nodes, self.per_process = nodes, per_process
        self.events: Any = ctx.Queue()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self._phases = itertools.count(1)
        for _ in range(math.ceil(nodes / per_process)):
            parent, child = ctx.Pipe()
            args = (child, self.events, port, str(log_path))
            proc = ctx.Process(target=_worker_main, args=args, daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_ready(self) -> None:
        for conn in self.conns:
            self._reply(conn, 180)  # torch's import, on a busy machine

    def indices(self, worker: int) -> list[int]:
        start = worker * self.per_process
        return list(range(start, min(start + self.per_process, self.nodes)))

    def _reply(self, conn: Connection, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise ScaleError(f"a worker process did not answer within {timeout_s:g} s")
        status, value = conn.recv()
        if status != "ok":
            raise ScaleError(f"worker process: {value}")
        return value

    def call(self, command: str, *args: Any, timeout_s: float = 30) -> list[Any]:
        """Every worker runs ``command`` (at the same time); their answers."""
        for conn in self.conns:
            conn.send((command, args))
        return [self._reply(conn, timeout_s) for conn in self.conns]

    def call_on(self, index: int, command: str, *args: Any) -> Any:
        """The worker hosting agent ``index`` runs ``command``."""
        conn = self.conns[index // self.per_process]
        conn.send((command, args))
        return self._reply(conn, 30)

    def make(self, run_id: str, conf: dict[str, str]) -> None:
        for worker, conn in enumerate(self.conns):
            conn.send(("make", (run_id, self.indices(worker), self.nodes, conf)))
        for conn in self.conns:
            self._reply(conn, 30)

    def next_phase(self) -> int:
        return next(self._phases)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("exit", ()))
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@contextlib.contextmanager
def fleet_of(nodes: int, per_process: int, port: int, log_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(nodes, per_process, port, log_path)
    try:
        fleet.wait_ready()
        yield fleet
    finally:
        fleet.close()


# -- the phases of one repetition --------------------------------------------------------------
def _complete(latest: dict[int, tuple[int, int, float]], expected: set[int]) -> bool:
    """Every expected agent returned from the same round, of exactly the expected size."""
    seen = [latest[i] for i in expected if i in latest]
    if len(seen) < len(expected):
        return False
    return len({s[0] for s in seen}) == 1 and all(s[1] == len(expected) for s in seen)


def await_round(
    events: Any, phase: int, expected: set[int], since: float, cap_s: float
) -> dict[str, Any]:
    """Read the agents' returns until ``expected`` share one full round, or the cap."""
    latest: dict[int, tuple[int, int, float]] = {}
    formed: set[tuple[int, int]] = set()  # (round, world) of every round an agent returned from
    error = None
    while not _complete(latest, expected):
        remaining = since + cap_s - time.monotonic()
        if remaining <= 0:
            error = f"no round of all {len(expected)} live agents within {cap_s:g} s"
            break
        try:
            ev_phase, index, kind, value, at = events.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if ev_phase != phase or index not in expected:
            continue  # a late return from an earlier phase
        if kind == "error":
            error = f"agent {index}: {value}"
            break
        round_, _, world = value
        latest[index] = (round_, world, at)
        formed.add((round_, world))
    size = len(expected)
    done = error is None
    return {
        "seconds": round(max(latest[i][2] for i in expected) - since, 3) if done else None,
        "agents": size,
        "round": latest[next(iter(expected))][0] if done else None,
        "rounds_formed": len({r for r, _ in formed}),
        # A round of fewer than the live agents went ahead without a live one: a false death.
        "live_left_out": sum(size - w for _, w in formed if w < size),
        "dead_included": sum(1 for _, w in formed if w > size),
        "error": error,
    }


def round_phase(
    fleet: Fleet, url: str, live: set[int], cap_s: float, fault: str | None, victim: int = -1
) -> dict[str, Any]:
    """Start the live agents' joins (after ``fault`` on ``victim``, at once) and time the
    round they form; etcd's work from just before the fault to the last return."""
    before = scrape(url)
    phase = fleet.next_phase()
    if fault is None:
        since = time.monotonic() + START_LEAD_S
    else:
        since = fleet.call_on(victim, fault, victim)
        live.discard(victim)
    fleet.call("join", phase, since)
    result = await_round(fleet.events, phase, live, since, cap_s)
    after = scrape(url)
    result["stuck_agents"] = sum(fleet.call("stop"))
    result["etcd"] = etcd_rates(before, after)
    return result


def quiet_phase(fleet: Fleet, url: str, quiet_s: float) -> dict[str, Any]:
    """Nothing changes: every agent's num_nodes_waiting() must stay 0."""
    time.sleep(SETTLE_S)
    before = scrape(url)
    answers = fleet.call("quiet", time.monotonic() + quiet_s, MONITOR_S, timeout_s=quiet_s + 60)
    after = scrape(url)
    positives = {i: n for answer in answers for i, n in answer.items()}
    flagged = sorted(i for i, n in positives.items() if n)
    return {
        "seconds": quiet_s,
        "false_deaths": len(flagged),
        "flagged_agents": flagged,
        "positive_polls": sum(positives.values()),
        "etcd": etcd_rates(before, after),
    }


def run_rep(fleet: Fleet, url: str, rep: int, config: ScaleConfig) -> dict[str, Any]:
    """A fresh run: first round, quiet window, one agent killed, one leaving."""
    n = fleet.nodes
    run_id = f"scale-{n}-{rep}-{uuid.uuid4().hex[:6]}"
    fleet.make(run_id, rendezvous_conf(config.cap_s))
    live = set(range(n))
    result: dict[str, Any] = {"rep": rep, "run_id": run_id}
    try:
        result["first"] = round_phase(fleet, url, live, config.cap_s, None)
        if result["first"]["error"] is None:
            result["quiet"] = quiet_phase(fleet, url, config.quiet_s)
            result["death"] = round_phase(fleet, url, live, config.cap_s, "kill", n - 1)
        if not result.get("death", {"error": "skipped"})["error"]:
            result["leave"] = round_phase(fleet, url, live, config.cap_s, "leave", n - 2)
    finally:
        fleet.call("close")
    phases = [result.get(p) for p in ("first", "death", "leave")]
    errors = [p["error"] for p in phases if p and p["error"]]
    result["error"] = errors[0] if errors else None
    result["false_deaths"] = result.get("quiet", {}).get("false_deaths", 0) + sum(
        p["live_left_out"] for p in phases if p
    )
    return result


def run_nodes(
    server: EmbeddedEtcd, n: int, config: ScaleConfig, out: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    """Every repetition at one node count, on a fleet of its own; stops at a failed rep."""
    reps: list[dict[str, Any]] = []
    with fleet_of(n, config.per_process, server.client_port, out / "workers.log") as fleet:
        say(f"N={n}: {len(fleet.procs)} worker processes ready")
        for rep in range(config.reps):
            result = run_rep(fleet, server.client_url, rep, config)
            reps.append(result)
            say(f"N={n} rep {rep + 1}/{config.reps}: {_rep_line(result)}")
            if result["error"]:
                break  # its stuck agents would weigh on the next rep's figures
    return {
        "nodes": n,
        "processes": len(fleet.procs),
        "reps": reps,
        "summary": summarize_reps(reps),
    }


def _rep_line(rep: dict[str, Any]) -> str:
    def s(phase: str) -> str:
        seconds = (rep.get(phase) or {}).get("seconds")
        return "-" if seconds is None else f"{seconds:.2f} s"

    quiet = (rep.get("quiet") or {}).get("etcd", {}).get("req_s", "-")
    text = (
        f"first round {s('first')}, re-form after death {s('death')}, after leave "
        f"{s('leave')}, false deaths {rep['false_deaths']}, etcd {quiet} req/s quiet"
    )
    return text + (f"; error: {rep['error']}" if rep["error"] else "")


# -- summaries, the model, the table -----------------------------------------------------------
def _values(reps: Sequence[dict[str, Any]], phase: str, *keys: str) -> list[float | None]:
    values: list[float | None] = []
    for rep in reps:
        value: Any = rep.get(phase)
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        values.append(value)
    return values


def summarize_reps(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max over the reps of every figure; false deaths summed."""
    return {
        "first_round_s": summarize_known(_values(reps, "first", "seconds")),
        "reform_death_s": summarize_known(_values(reps, "death", "seconds")),
        "reform_leave_s": summarize_known(_values(reps, "leave", "seconds")),
        "quiet_req_s": summarize_known(_values(reps, "quiet", "etcd", "req_s")),
        "reform_req_s": summarize_known(_values(reps, "death", "etcd", "req_s")),
        "reform_requests": summarize_known(_values(reps, "death", "etcd", "requests")),
        "reform_leave_req_s": summarize_known(_values(reps, "leave", "etcd", "req_s")),
        "reform_etcd_cpu_s": summarize_known(_values(reps, "death", "etcd", "etcd_cpu_s")),
        "reform_etcd_cores": summarize_known(_values(reps, "death", "etcd", "etcd_cpu_share")),
        "false_deaths": sum(rep["false_deaths"] for rep in reps),
        "errors": [rep["error"] for rep in reps if rep["error"]],
    }


def _median(summary: dict[str, Any], key: str) -> float | None:
    value = summary.get(key)
    return value["median"] if value else None


def measured_row(result: dict[str, Any]) -> dict[str, Any]:
    summary = result["summary"]
    keys = (
        "first_round_s",
        "reform_death_s",
        "reform_leave_s",
        "quiet_req_s",
        "reform_req_s",
        "reform_etcd_cores",
    )
    return {
        "nodes": result["nodes"],
        "source": "measured",
        **{key: _median(summary, key) for key in keys},
        "false_deaths": summary["false_deaths"],
    }


def build_model(
    measured: Sequence[dict[str, Any]], interval_s: float, nodes: Sequence[int]
) -> dict[str, Any]:
    """The model calibrated on every node count with all figures measured, or why not."""
    points = []
    for result in measured:
        summary = result["summary"]
        keys = ("first_round_s", "reform_death_s", "reform_leave_s", "quiet_req_s")
        medians = [_median(summary, key) for key in (*keys, "reform_requests", "reform_etcd_cpu_s")]
        if all(m is not None for m in medians):
            points.append(model.Point(result["nodes"], *medians))  # type: ignore[arg-type]
    if len({p.nodes for p in points}) < 2:
        return {"error": "the model needs complete measurements at two node counts or more"}
    cal = model.calibrate(points, interval_s)
    return {
        "calibration": asdict(cal),
        "assumptions": model.assumptions(cal),
        "rows": [model.predict(cal, n) for n in nodes if n > max(cal.nodes)],
    }


COLUMNS = (
    ("nodes", "N", "{:d}"),
    ("source", "source", "{}"),
    ("first_round_s", "first round s", "{:.2f}"),
    ("reform_death_s", "re-form after death s", "{:.2f}"),
    ("reform_leave_s", "re-form after leave s", "{:.2f}"),
    ("false_deaths", "false deaths", "{:d}"),
    ("quiet_req_s", "etcd req/s quiet", "{:.1f}"),
    ("reform_req_s", "etcd req/s re-form", "{:.0f}"),
    ("reform_etcd_cores", "etcd cores re-form", "{:.2f}"),
)


def table_text(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table; a missing figure is '-', an unmodelled one 'n/a'."""

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        if value is None:
            return "n/a" if row["source"] == "model" else "-"
        return fmt.format(value)

    cells = [[header for _, header, _ in COLUMNS]]
    cells += [[cell(row, key, fmt) for key, _, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def harness_assumptions(config: ScaleConfig, conf: dict[str, str]) -> list[str]:
    return [
        "An agent is the training's SpotRendezvousHandler (training.rendezvous.create_handler, "
        "with its own etcd clients and TCP probe port), without workers. A 2-core machine "
        f"cannot run one process per agent: spawned worker processes host up to "
        f"{config.per_process} agents each, in threads, so agents of one process share its "
        "GIL and answer probes later than separate processes would.",
        "One etcd 3.5 member (v2 API, the lab's flags) on loopback for every N and rep; each "
        "rep is a fresh run id. Times are CLOCK_MONOTONIC, common to all processes.",
        f"The shipped settings (training/launch.py RendezvousSettings: {conf}, probe timeout "
        f"{PROBE_TIMEOUT_S:g} s), except join_timeout lowered to the {config.cap_s} s cap. "
        "min_nodes 1, max_nodes N.",
        "First round: from the common start of N joins to the last next_rendezvous return, "
        "every agent in one round of N.",
        "Death: the agent's heartbeats stop and its probe port refuses, without leaving (what "
        "SIGKILL leaves); the survivors call next_rendezvous at once (their workers failed). "
        "Leave: leave(), then the others call next_rendezvous at once. Timed from the fault to "
        "the last survivor's return in one round of all live agents.",
        "After returning, every agent runs torch's monitor loop (num_nodes_waiting every "
        f"{MONITOR_S:g} s, joining again when > 0), so a wrong round re-forms as in training.",
        f"False deaths: agents whose num_nodes_waiting() was > 0 in a {config.quiet_s:g} s "
        f"quiet window after the first round (polled every {MONITOR_S:g} s, after "
        f"{SETTLE_S:g} s to settle), plus live agents left out of any round that formed.",
        "etcd req/s: from etcd's /metrics, etcd_http_received_total (v2 reads and writes) plus "
        "etcd_debugging_store_watch_requests_total (v2 watches, which the former leaves out), "
        "over the quiet window, and over each re-form after a death from just before the kill "
        "to the last return; etcd cores: etcd's process_cpu_seconds_total over the same "
        "re-form window (on this shared 2-core machine).",
    ]


def run_scale(config: ScaleConfig, out: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Every node count against one etcd, then the model beyond the largest."""
    conf = rendezvous_conf(config.cap_s)
    binary = find_etcd_binary()
    with (
        tempfile.TemporaryDirectory(prefix="rdzv-scale-") as data,
        EmbeddedEtcd(binary, Path(data) / "etcd", out / "etcd.log") as server,
    ):
        say(f"etcd on {server.client_url}")
        measured = [run_nodes(server, n, config, out, say) for n in config.nodes]
    interval = float(RendezvousSettings().keep_alive_interval_s)
    fitted = build_model(measured, interval, config.model_nodes)
    return {
        "settings": {**asdict(config), "rendezvous_conf": conf, "probe_timeout_s": PROBE_TIMEOUT_S},
        "assumptions": harness_assumptions(config, conf),
        "measured": measured,
        "model": fitted,
        "rows": [measured_row(m) for m in measured] + fitted.get("rows", []),
    }


def report_text(results: dict[str, Any]) -> str:
    """The table, then what the measured and the modelled rows assume."""
    lines = [table_text(results["rows"]), "", "Measured rows:"]
    lines += [f"- {a}" for a in results["assumptions"]]
    fitted = results["model"]
    if "error" in fitted:
        lines += ["", f"No model: {fitted['error']}."]
    else:
        lines += ["", "Model rows:"] + [f"- {a}" for a in fitted["assumptions"]]
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------
def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    defaults = ScaleConfig()
    parser = argparse.ArgumentParser(
        prog="python -m bench rendezvous-scale",
        description="Run N rendezvous agents (the training's handler, without workers) "
        "against one etcd 3.5: first round, re-form after a death and after a leave, false "
        "deaths, etcd requests/s; then a model calibrated on them for larger N. Exit status: "
        "0 done, 1 a round did not form, 2 bad input, 130 interrupted.",
    )

    def csv(values: tuple[int, ...]) -> str:
        return ",".join(map(str, values))

    parser.add_argument(
        "--nodes", type=_counts, help=f"node counts to run (default {csv(defaults.nodes)})"
    )
    parser.add_argument("--reps", type=int, help=f"repetitions per count (default {defaults.reps})")
    parser.add_argument(
        "--quiet-s",
        type=float,
        help=f"quiet window for false deaths (default {defaults.quiet_s:g})",
    )
    parser.add_argument(
        "--per-process",
        type=int,
        help=f"agents per worker process (default {defaults.per_process})",
    )
    parser.add_argument(
        "--cap-s", type=int, help=f"give a round up after this long (default {defaults.cap_s})"
    )
    parser.add_argument(
        "--model-nodes",
        type=_counts,
        help=f"node counts to model beyond the largest run (default {csv(defaults.model_nodes)})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output dir (default bench-results/rendezvous-scale-<timestamp>); must be new",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    return parser


def config_from_args(args: argparse.Namespace) -> ScaleConfig:
    given = {
        key: getattr(args, key)
        for key in ("nodes", "reps", "quiet_s", "per_process", "cap_s", "model_nodes")
        if getattr(args, key) is not None
    }
    config = ScaleConfig(**given)
    config.validate()
    return config


def _out_dir(path: Path | None) -> Path:
    out = path or Path("bench-results") / f"rendezvous-scale-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out: {out} already exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    """``python -m bench rendezvous-scale [flags]``; returns the exit status."""
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        config = config_from_args(args)
        find_etcd_binary()  # fail before anything starts
        out = _out_dir(args.out)
        results = run_scale(config, out, _say)
    except (ValueError, EtcdError) as err:
        _say(f"error: {err}")
        return EXIT_BAD_INPUT
    except ScaleError as err:
        _say(f"benchmark failed: {err}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _say("\ninterrupted; the agents' processes and etcd are stopped")
        return EXIT_INTERRUPTED
    results["command"] = ["python", "-m", "bench", "rendezvous-scale", *argv]
    text = report_text(results)
    (out / "rendezvous-scale.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "rendezvous-scale.txt").write_text(text + "\n")
    print(json.dumps(results, indent=2) if args.json else text)
    _say(f"results: {out / 'rendezvous-scale.json'}")
    failed = [m["nodes"] for m in results["measured"] if m["summary"]["errors"]]
    for nodes in failed:
        _say(f"N={nodes}: a round did not form; see {out / 'workers.log'}")
    return EXIT_FAILED if failed else EXIT_OK
