"""Every resource keeps its URN, or an alias that names it: an ``up`` on a stack made before the
one-object components were folded into ``LabWorkloads`` replaces nothing. ``urns/`` holds the
engine's URNs of every resource the program registered before, for the dev stack and for one
that takes every branch (the on-demand fallback, InfiniBand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.pulumi_harness import ProgramRun, run_program

PINNED = Path(__file__).resolve().parent / "urns"
ND = {"gpuVmSize": "Standard_ND96asr_v4", "workerCpu": "80", "workerMemory": "800Gi"}
STACKS = {"dev": {}, "dev-every-branch": {**ND, "rdma": "auto", "onDemandMaxNodes": "2"}}
FOLDED = ("PriorityClasses", "TrainingOperator", "NvidiaDevicePlugin", "AutoscalerPriorities")
"""The components whose objects ``LabWorkloads`` holds now: they held no state of their own."""


def _pinned(stack: str) -> set[str]:
    return set((PINNED / f"{stack}.txt").read_text().split())


def _folded_component(urn: str) -> bool:
    type_chain = urn.split("::")[2]
    return any(type_chain.endswith(f"spot-lab:workloads:{name}") for name in FOLDED)


@pytest.fixture(scope="module", params=sorted(STACKS))
def stack_run(request: pytest.FixtureRequest) -> tuple[str, ProgramRun]:
    return request.param, run_program("dev", STACKS[request.param])


def test_every_pinned_resource_is_kept_at_its_urn_or_an_alias(
    stack_run: tuple[str, ProgramRun],
) -> None:
    stack, run = stack_run
    claimed: dict[str, str] = {}
    for resource in run.resources:
        for urn in {resource.engine_urn, *resource.alias_urns}:
            assert claimed.setdefault(urn, resource.engine_urn) == resource.engine_urn, urn
    kept = {urn for urn in _pinned(stack) if not _folded_component(urn)}
    assert sorted(kept - set(claimed)) == []


def test_nothing_is_new_and_only_the_folded_components_are_gone(
    stack_run: tuple[str, ProgramRun],
) -> None:
    stack, run = stack_run
    now = {resource.engine_urn for resource in run.resources}
    pinned = _pinned(stack)
    moved = {
        resource.engine_urn
        for resource in run.resources
        if resource.engine_urn not in pinned and set(resource.alias_urns) & pinned
    }
    assert sorted(now - pinned - moved) == []
    gone = pinned - now - {u for r in run.resources for u in r.alias_urns}
    assert gone and all(_folded_component(urn) for urn in gone)


def test_the_folded_objects_sit_under_lab_workloads(stack_run: tuple[str, ProgramRun]) -> None:
    _, run = stack_run
    moved = [r for r in run.resources if any(_folded_parent(u) for u in r.alias_urns)]
    assert {r.name for r in moved} >= {
        "workloads-priority-training",
        "workloads-priority-rendezvous",
        "workloads-operator-kustomize",
        "workloads-device-plugin-daemonset",
    }
    assert {r.parent_type for r in moved} == {"spot-lab:workloads:LabWorkloads"}


def _folded_parent(urn: str) -> bool:
    parents = urn.split("::")[2].split("$")[:-1]
    return bool(parents) and _folded_component("::".join(["", "", "$".join(parents)]))
