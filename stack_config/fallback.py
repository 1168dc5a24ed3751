"""The on-demand fallback's rules: its pool's bounds, the Spot wait, and what the first round's
join timeout must outlast.

With the fallback on, a job whose Spot pool cannot grow still starts: the cluster autoscaler
gives the Spot pool ``fallbackAfterMinutes`` (its ``max-node-provision-time``: "After this
time, if they are still unregistered, it stops considering them in simulations and may attempt
to scale up a different group if the pods are still pending", kubernetes/autoscaler
``cluster-autoscaler/FAQ.md``, "How does scale-up work?"), then scales the on-demand pool, whose
VM must start, register, pull the image and join. The first rendezvous round waits
``rdzvJoinTimeout`` for ``workerMinReplicas``; shorter than both, and the job fails for good
with "too few nodes joined" before the fallback's node arrives. So an unset ``rdzvJoinTimeout``
follows the fallback (``join_timeout_default``), and one set explicitly is checked.
"""

from __future__ import annotations

from dataclasses import replace

from catalog.gpu_pools import MAX_GPU_NODES
from stack_config.model import LabConfig

VM_START_S = 600
"""Seconds from the autoscaler's scale-up of the on-demand pool to a worker that has joined:
Azure creates the GPU VM, AKS provisions it (the NVIDIA driver install included) and registers
it, the device plugin advertises its GPUs, the node pulls the multi-GB CUDA image and the agent
starts. Microsoft's answer on AKS GPU scale-out (learn.microsoft.com/answers/a/12767836) puts
5-10 minutes from the autoscaler's decision to a running pod as expected for GPU nodes, ~10
observed; the autoscaler itself allows a registered node 15 minutes to become ready
(``clusterstate.go``, ``MaxNodeStartupTime``). 10 minutes is the planning figure: the typical
upper end, not the worst case."""
MIN_AFTER_MINUTES = 5
"""Below this, a Spot GPU node that is only slow to register (its driver is installed before
the kubelet joins) is given up and the job moves to on-demand for nothing."""


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def with_join_timeout_default(cfg: LabConfig) -> LabConfig:
    """``cfg`` with the join timeout a stack that does not set ``rdzvJoinTimeout`` gets: the
    rendezvous' own default, or with the fallback on, at least the Spot wait plus an on-demand
    VM's start (what ``_join_timeout_problems`` asks of a set value)."""
    rdzv = cfg.job.rendezvous
    join = type(rdzv)().join_timeout_s
    after = cfg.fallback.after_minutes
    if cfg.fallback.enabled and _count(after) and after >= MIN_AFTER_MINUTES:
        join = max(join, after * 60 + VM_START_S)
    job = replace(cfg.job, rendezvous=replace(rdzv, join_timeout_s=join))
    return replace(cfg, job=job)


def gpu_node_total_problems(cfg: LabConfig) -> list[str]:
    """The GPU pools' ceilings together (Spot and on-demand) stay within the unready nodes the
    cluster autoscaler is told to tolerate (``catalog.gpu_pools.MAX_GPU_NODES``)."""
    on_demand = cfg.fallback.max_nodes if cfg.fallback.enabled else 0
    total = cfg.gpu_max_nodes
    if not (_count(total) and _count(on_demand)) or total + on_demand <= MAX_GPU_NODES:
        return []
    pool = "gpuMaxNodes" if cfg.gpu_pool.max_nodes is not None else "workerMaxReplicas"
    return [
        f"{cfg.key(pool)} ({total}) plus {cfg.key('onDemandMaxNodes')} ({on_demand}) must be at "
        f"most {MAX_GPU_NODES} GPU nodes: the cluster autoscaler is told to tolerate that many "
        "unready nodes, so that an eviction wave never halts it"
    ]


def fallback_problems(cfg: LabConfig) -> list[str]:
    """Every broken rule of the fallback's keys, each naming its key and what is allowed."""
    fallback, job = cfg.fallback, cfg.job
    high = cfg.key("onDemandMaxNodes")
    problems = []
    if not _count(fallback.max_nodes) or fallback.max_nodes < 0:
        problems.append(
            f"{high} must be 0 (no on-demand fallback) or a count of on-demand GPU nodes >= 1, "
            f"got {fallback.max_nodes!r}"
        )
    elif _count(job.max_replicas) and fallback.max_nodes > job.max_replicas:
        problems.append(
            f"{high} ({fallback.max_nodes}) must be 0..{cfg.key('workerMaxReplicas')} "
            f"({job.max_replicas}): one worker per GPU node, so more on-demand nodes are never used"
        )
    after = fallback.after_minutes
    if not _count(after) or after < MIN_AFTER_MINUTES:
        problems.append(
            f"{cfg.key('fallbackAfterMinutes')} must be a whole number of minutes >= "
            f"{MIN_AFTER_MINUTES} (AKS takes max-node-provision-time in whole minutes, and a Spot "
            f"GPU node given less is often dropped while it still registers), got {after!r}"
        )
    elif fallback.enabled:
        problems += _join_timeout_problems(cfg)
    return problems


def _join_timeout_problems(cfg: LabConfig) -> list[str]:
    """The first round must still be waiting when the fallback's first worker joins."""
    join = cfg.job.rendezvous.join_timeout_s
    wait_s = cfg.fallback.after_minutes * 60
    needed = wait_s + VM_START_S
    if not _count(join) or join >= needed:
        return []
    key, after = cfg.key("rdzvJoinTimeout"), cfg.key("fallbackAfterMinutes")
    return [
        f"{key} ({join} s) is shorter than the on-demand fallback needs: {after} "
        f"({cfg.fallback.after_minutes} min = {wait_s} s) for the Spot pool, then {VM_START_S} s "
        f"for an on-demand VM to start and its worker to join, {needed} s in all; set {key} to "
        f"{needed} or more, or lower {after}"
    ]
