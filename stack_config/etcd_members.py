"""The rendezvous' etcd against the system pool: how many members, and a node for each.

etcd keeps its members one per system node (a required anti-affinity,
``workloads/manifests/etcd.py``), so the pool needs a node per member; an even count adds a
member without adding a node the quorum can lose.
"""

from __future__ import annotations

from stack_config.model import LabConfig


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def etcd_member_problems(cfg: LabConfig) -> list[str]:
    """``etcdMembers`` is 1 or odd and >= 3, and ``systemNodeCount`` has a node for each."""
    members, nodes = cfg.etcd_members, cfg.cluster.system_node_count
    if not _count(members) or not (members == 1 or (members >= 3 and members % 2)):
        return [
            f"{cfg.key('etcdMembers')} must be 1 (a throwaway dev stack) or an odd number >= 3 "
            f"(a quorum that outlives a lost node), got {members!r}"
        ]
    if _count(nodes) and nodes < members:
        return [
            f"{cfg.key('systemNodeCount')} ({nodes}) must be >= {cfg.key('etcdMembers')} "
            f"({members}): each etcd member needs a system node of its own"
        ]
    return []
