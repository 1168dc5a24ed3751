"""The GPU node's agent: Azure's eviction notice reaches the workers on the node.

A DaemonSet on the GPU pools (``workloads/manifests/node_agent.py``) runs
``python -m training.node_agent`` from the training image, which every GPU node pulls anyway. It
polls Azure Scheduled Events (``scheduled_events``) every second; on a ``Preempt`` of its own VM
it deletes the node's worker pods gracefully (SIGTERM and their stop deadline) and cordons the
node, and once a preempted VM's ``NotBefore`` has passed, or its Node is gone, it force-deletes
the worker pods still bound there, so the operator recreates them at once (``cluster``). It never
acknowledges an event. Imports nothing else of ``training``.
"""
