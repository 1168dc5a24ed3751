"""The Kubernetes side of ``pulumi up``: everything the elastic training job runs on.

``workloads.lab_workloads.LabWorkloads`` creates the single objects (priority classes, the
device plugin, the operator's overlay, the autoscaler's priorities) and composes the components
in this package, one per concept of several objects (``namespace``, ``etcd``, ``node_agent``,
``network_operator``, ``volume``, ``data_staging``, ``job``); the objects themselves come from
the pure builders in ``workloads.manifests``.

Nothing is imported here on purpose: ``import workloads.manifests.etcd`` must work without
pulumi installed, so the local lab can reuse the builders and the rendezvous settings.
"""
