"""The cluster autoscaler's priority expander ConfigMap: the Spot pool first, then the
on-demand fallback pool of the same size.

What the sources say, and the shape that follows from them:

- The expander reads ConfigMap ``cluster-autoscaler-priority-expander``, key ``priorities``, "in
  the same namespace as cluster autoscaler pod" (kubernetes/autoscaler
  ``cluster-autoscaler/expander/priority/readme.md``), i.e. ``kube-system``: AKS's managed
  autoscaler keeps its status there too (``cluster-autoscaler-status``), and users of AKS's
  priority expander put it there (Azure/AKS issues 1931, shipped; 4348; 5136).
- The value is YAML of ``map[int][]string``: each priority with a *list* of regexes
  (``priority.go``, ``parsePrioritiesYAMLString``; a bare string fails to parse, as in
  kubernetes/autoscaler issue 8321). "The highest value wins"; several groups at the highest
  priority are chosen among at random.
- Each regex is matched, unanchored, against the node group's id (``groupIDMatchesList``:
  ``re.FindStringIndex(id)``), which on AKS is the pool's scale set, ``aks-<pool>-<digits>-vmss``
  (``catalog/gpu_pools.py``). A group that matches no entry "won't be used"
  (``PriorityConfigMapNotMatchedGroup``), so a last catch-all keeps any pool the user adds.
- Without the ConfigMap, ``BestOption`` returns nothing and no pool scales up at all: it must
  exist before the job's pods are pending (``workloads/lab_workloads.py`` orders it so).

Pure: builds plain dicts.
"""

from __future__ import annotations

from typing import Any

import yaml

from catalog.gpu_pools import ON_DEMAND_PREFIX, SPOT_PREFIX, scale_set_pattern

PRIORITY_CONFIGMAP = "cluster-autoscaler-priority-expander"
AUTOSCALER_NAMESPACE = "kube-system"
SPOT_PRIORITY = 20
ON_DEMAND_PRIORITY = 10
ANY_OTHER_PRIORITY = 1


def expander_priorities() -> dict[int, list[str]]:
    """Priority -> regexes of node group ids: every generation of the Spot pool, then every
    generation of the on-demand pool, then any other pool."""
    return {
        SPOT_PRIORITY: [scale_set_pattern(SPOT_PREFIX)],
        ON_DEMAND_PRIORITY: [scale_set_pattern(ON_DEMAND_PREFIX)],
        ANY_OTHER_PRIORITY: [".*"],
    }


def priority_expander_configmap() -> dict[str, Any]:
    """The ConfigMap the AKS cluster autoscaler's priority expander reads."""
    priorities = yaml.safe_dump(expander_priorities(), sort_keys=False, default_flow_style=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": PRIORITY_CONFIGMAP,
            "namespace": AUTOSCALER_NAMESPACE,
            "labels": {"app.kubernetes.io/part-of": "spot-lab"},
        },
        "data": {"priorities": priorities},
    }
