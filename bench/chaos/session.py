"""One schedule end to end, in a lab workspace: etcd, the nodes, the faults, the checks.

The lab's own pieces (``lab/local/``: the workspace that always cleans up, the embedded etcd,
the node set, the runner), with the workers' durable store behind the faulty store of
``bench/chaos/faulty_store.py`` and the campaign's runner (``bench/chaos/runner.py``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from bench.chaos.faulty_store import faulty_env
from bench.chaos.invariants import Evidence, check
from bench.chaos.plan import ChaosPlan
from bench.chaos.runner import ChaosRunner, StoreControl
from bench.chaos.schedule import NETWORK_FAULTS, Schedule
from lab.live.event_log import LabEventLog
from lab.local.etcd_server import HOST, EmbeddedEtcd
from lab.local.netns import Network
from lab.local.node import TorchrunNode
from lab.local.scenario import Scenario, validate_scenario
from lab.local.session import NodeSet, lab_workspace
from lab.report.node_logs import read_jsonl, read_records
from training.checkpoints.sharded.repository import ShardedCheckpoints
from training.checkpoints.storage import FileStore
from training.elastic.launch import ElasticPolicy


class ChaosNodes(NodeSet):
    """The lab's nodes, each with its durable store behind the campaign's faulty store."""

    def __init__(self, *args: Any, store: StoreControl, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = store
        self.store_logs: dict[str, Path] = {}

    def make(self, number: int) -> TorchrunNode:
        node = super().make(number)
        env = {**node.launch.env, **faulty_env(self.store.control, self.store.log_of(number))}
        node.launch = dataclasses.replace(node.launch, env=env)
        self.store_logs[node.name] = self.store.log_of(number)
        return node


def final_state(checkpoints: Path) -> tuple[int | None, dict[str, torch.Tensor] | None]:
    """(step, model parameters) of the newest checkpoint that verifies, or (None, None)."""
    scratch = checkpoints.parent / f".{checkpoints.name}-read"
    read = ShardedCheckpoints(FileStore(checkpoints), scratch).read_whole("model.model.")
    return (None, None) if read is None else (read[0].step, read[1])


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _policy(scenario: Scenario, port: int, host: str) -> ElasticPolicy:
    return ElasticPolicy(
        rdzv_host=host,
        rdzv_port=port,
        rdzv_id=f"chaos-{uuid.uuid4().hex[:12]}",  # a closed rendezvous stays closed
        min_nodes=scenario.min_nodes,
        max_nodes=scenario.max_nodes,
        max_restarts=scenario.max_restarts,
        nproc_per_node=scenario.nproc_per_node,
        rendezvous=scenario.rendezvous,
    )


def run_schedule(
    schedule: Schedule,
    plan: ChaosPlan,
    *,
    data_dir: Path,
    out: Path,
    reference: dict[str, torch.Tensor],
    etcd_binary: Path,
    python: str,
) -> dict[str, Any]:
    """Run ``schedule``, check every invariant; the result (also ``out/schedule.json``)."""
    scenario = plan.scenario(f"chaos-{schedule.seed}", schedule.nproc_per_node)
    validate_scenario(scenario)
    out.mkdir(parents=True, exist_ok=False)
    with lab_workspace() as work, ExitStack() as stack:
        # A partition or an etcd-cut needs each node in a network namespace, etcd on the bridge
        # where they all reach it; the durable store is a directory, which every namespace sees.
        network = None
        if any(f.kind in NETWORK_FAULTS for f in schedule.faults):
            network = stack.enter_context(Network([]))
        host = network.host_addr if network is not None else HOST
        etcd = stack.enter_context(
            EmbeddedEtcd(etcd_binary, work / "etcd", out / "etcd.log", host=host)
        )
        store = StoreControl(work / "store-control.jsonl", out / "store")
        nodes = stack.enter_context(
            ChaosNodes(
                scenario,
                _policy(scenario, etcd.client_port, host),
                work,
                out / "nodes",
                data_dir,
                python,
                network,
                store=store,
            )
        )
        lab_log = LabEventLog(out / "lab-events.jsonl")
        runner = ChaosRunner(
            scenario,
            [],
            nodes.make,
            etcd,
            lab_log,
            poll_s=0.05,
            schedule=schedule,
            etcd=etcd,
            store=store,
            checkpoints=work / "checkpoints",
            grace_s=plan.grace_s,
            network=network,
        )
        outcome = runner.run()
        final_codes = {node.name: node.poll() for node in nodes.nodes}
        newest, params = final_state(work / "checkpoints")
    evidence = Evidence(
        records=read_records(out / "nodes"),
        lab_events=read_jsonl(out / "lab-events.jsonl"),
        actions=runner.actions,
        final_codes=final_codes,
        agent_logs={p.stem: p.read_text(errors="replace") for p in (out / "nodes").glob("*.log")},
        ack_checks=runner.ack_checks,
        newest_verified=newest,
        parameter_difference=max_difference(params, reference) if params else None,
        status=outcome.status,
        max_steps=plan.max_steps,
        stop_deadline_s=plan.stop_deadline_s,
        nproc_per_node=schedule.nproc_per_node,
        store_calls={
            name: read_jsonl(path) for name, path in nodes.store_logs.items() if path.exists()
        },
    )
    verdict, figures = check(evidence)
    result = {
        "seed": schedule.seed,
        "faults": [f.as_dict() for f in schedule.faults],
        "described": schedule.describe(),
        "nproc_per_node": schedule.nproc_per_node,
        "status": outcome.status,
        "message": outcome.message,
        "actions": runner.actions,
        "exit_codes": final_codes,
        "newest_verified": newest,
        "parameter_difference": evidence.parameter_difference,
        "violations": verdict.violations,
        "excused": verdict.excused,
        **figures,
        "out": str(out),
    }
    (out / "schedule.json").write_text(json.dumps(result, indent=1) + "\n")
    return result
