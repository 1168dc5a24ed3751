"""The Kubernetes side of ``pulumi up``: everything the elastic training job runs on.

``workloads.lab_workloads.LabWorkloads`` composes the Pulumi components in this package
(``namespace``, ``priority``, ``etcd``, ``device_plugin``, ``operator``, ``volume``, ``job``);
the objects themselves come from the pure builders in ``workloads.manifests``.

Nothing is imported here on purpose: ``import workloads.manifests.etcd`` must work without
pulumi installed, so the local lab can reuse the builders and the rendezvous settings.
"""
